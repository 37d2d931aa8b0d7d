#!/bin/bash
#SBATCH --time=08:00:00
#SBATCH --gres=gpu:1
# The token is made at run time and written to a file only the user reads.
umask 077
token=$(openssl rand -hex 32)
printf '%s\n' "$token" > "$HOME/.jupyter/token.$SLURM_JOB_ID"
port=$(shuf -i 20000-30000 -n 1)
echo "ssh -L $port:$(hostname):$port $USER@login.cluster.example"
jupyter lab --no-browser --port="$port" --ip=0.0.0.0 --IdentityProvider.token_file="$HOME/.jupyter/token.$SLURM_JOB_ID"
