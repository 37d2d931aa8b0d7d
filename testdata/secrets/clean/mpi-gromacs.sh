#!/bin/bash
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-task=1
#SBATCH --account=chem-2024-17
module load gromacs/2024.1-cuda
export GMX_ENABLE_DIRECT_GPU_COMM=1
export UCX_TLS=rc,sm,cuda_copy,cuda_ipc
export UCX_NET_DEVICES=mlx5_0:1
export OMPI_MCA_pml=ucx
srun gmx_mpi mdrun -s topol.tpr -deffnm md_0_1 -nb gpu -pme gpu -bonded gpu -update gpu -ntomp 8
