//! Other tools' device programs, read back from the kernel and judged in
//! the project's interpreter ([`crate::interp`]): what `gpufence doctor`
//! says of each program that runs for a process besides the fence.
//!
//! The kernel runs every effective device program of a task's cgroup and
//! denies the access when any returns 0 (`bpf_prog_run_array_cg` in
//! `kernel/bpf/cgroup.c`: `if (!func_ret) run_ctx.retval = -EPERM`), so
//! one program that denies is enough. A program that only reads its
//! context, compares and returns (Slurm's, systemd's, runc's and crun's
//! are such) is evaluated exactly. One that calls a helper or reads a map
//! is not: the instructions the kernel gives back hide call targets and
//! maps ([`crate::sys::prog_xlated`]), and its answer may depend on state
//! the reader cannot see. It is then said to *may deny*, with that reason.

use gpufence_model::device::{Access, DevNum};

use crate::asm::RawInsn;
use crate::interp::{self, Env};
use crate::uapi::{opcode, DEVCG_DEV_CHAR};

/// What one program answers for one access.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// It returns non-zero: it lets the access through (others may not).
    Allows,
    /// It returns 0: the kernel denies the access (`EPERM`).
    Denies,
    /// It could not be evaluated; why.
    MayDeny(String),
}

/// A world without maps or helpers: a program that reaches for one is not
/// evaluated (checked before running, so this never answers).
struct Bare;

impl Env for Bare {
    fn key_size(&self, _fd: i32) -> Option<usize> {
        None
    }
    fn map_lookup(&self, _fd: i32, _key: &[u8]) -> Option<Vec<u8>> {
        None
    }
    fn ancestor_cgroup_id(&self, _level: u64) -> u64 {
        0
    }
}

/// Why `insns` cannot be evaluated exactly, if so: a helper or kfunc call,
/// a 64-bit load (a map reference), a call to a subprogram.
fn not_straight(insns: &[RawInsn]) -> Option<String> {
    let call = opcode::CLASS_JMP | opcode::JMP_CALL;
    for (pc, i) in insns.iter().enumerate() {
        if i.code == call {
            return Some(format!("it calls the kernel (instruction {pc}): its answer may depend on state doctor cannot see"));
        }
        if i.code == opcode::LD_IMM64 {
            return Some(format!(
                "it reads a map (instruction {pc}): its answer depends on the map's contents"
            ));
        }
    }
    None
}

/// The answer of program `insns` (as [`crate::sys::prog_xlated`] gives
/// them) to a `access` of character device `dev`: the program is run in
/// the interpreter with `bpf_cgroup_dev_ctx { access_type, major, minor }`
/// (`include/uapi/linux/bpf.h`).
pub fn answer(insns: &[RawInsn], dev: DevNum, access: Access) -> Answer {
    if insns.is_empty() {
        return Answer::MayDeny("its instructions cannot be read".into());
    }
    if let Some(why) = not_straight(insns) {
        return Answer::MayDeny(why);
    }
    let ctx = [
        DEVCG_DEV_CHAR as u32 | (access.bits() << 16),
        dev.major,
        dev.minor,
    ];
    match interp::run(insns, ctx, &Bare) {
        Ok(0) => Answer::Denies,
        Ok(_) => Answer::Allows,
        Err(e) => Answer::MayDeny(format!("the interpreter cannot run it: {e}")),
    }
}

/// The name Slurm's cgroup/v2 plugin loads its device programs under
/// (`load_ebpf_prog`, `src/plugins/cgroup/v2/ebpf.c`).
pub const SLURM_PROG_NAME: &str = "Slurm_Cgroup_v2";

/// Whether `insns` have the shape of Slurm's cgroup/v2 device program
/// (`src/plugins/cgroup/v2/ebpf.c`): `init_ebpf_prog`'s six instructions
/// (type to r2, access to r3, major to r4, minor to r5), then blocks of
/// `add_device_ebpf_prog` (one to three `JNE` on r2, r4, r5 jumping past
/// the block, `r0 = accept`, `exit`), then `close_ebpf_prog`'s `r0 =
/// default`, `exit`. With its name ([`SLURM_PROG_NAME`]) this names the
/// owner; neither alone does.
pub fn slurm_shaped(insns: &[RawInsn]) -> bool {
    use opcode::*;
    let ldx_w = CLASS_LDX | MODE_MEM | SIZE_W;
    let alu32_k = |op: u8| CLASS_ALU | op | SRC_K;
    let init: [(u8, u8, i16, i32); 6] = [
        (ldx_w, 0x12, 0, 0),
        (alu32_k(ALU_AND), 0x02, 0, 0xFFFF),
        (ldx_w, 0x13, 0, 0),
        (alu32_k(ALU_RSH), 0x03, 0, 16),
        (ldx_w, 0x14, 4, 0),
        (ldx_w, 0x15, 8, 0),
    ];
    if insns.len() < init.len() + 2 {
        return false;
    }
    if !insns
        .iter()
        .zip(init.iter())
        .all(|(i, &(code, regs, off, imm))| {
            i.code == code && i.regs == regs && i.off == off && i.imm == imm
        })
    {
        return false;
    }
    let jne = CLASS_JMP | JMP_JNE | SRC_K;
    let mov_r0 = |i: &RawInsn| i.code == CLASS_ALU64 | ALU_MOV | SRC_K && i.regs == 0;
    let exit = |i: &RawInsn| i.code == CLASS_JMP | JMP_EXIT;
    let mut pc = init.len();
    loop {
        let mut checks = 0usize;
        while let Some(i) = insns.get(pc) {
            if i.code != jne || ![2u8, 4, 5].contains(&(i.regs & 0xf)) || i.regs >> 4 != 0 {
                break;
            }
            checks += 1;
            pc += 1;
        }
        let (Some(m), Some(e)) = (insns.get(pc), insns.get(pc + 1)) else {
            return false;
        };
        if !mov_r0(m) || !exit(e) || checks > 3 {
            return false;
        }
        pc += 2;
        if checks == 0 {
            // close_ebpf_prog: the end.
            return pc == insns.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::asm::{AluOp, Asm, JmpOp, Reg, Size};

    /// The program Slurm 23.11-26.05 builds for a job given 195:0 of two
    /// GPUs in gres.conf: 195:1 denied, default allow
    /// (`src/plugins/cgroup/v2/ebpf.c`).
    pub(crate) fn slurm_program(deny: &[(u32, u32)]) -> Vec<RawInsn> {
        let mut a = Asm::new();
        a.load(Size::W, Reg::R2, Reg::R1, 0)
            .alu32_imm(AluOp::And, Reg::R2, 0xFFFF)
            .load(Size::W, Reg::R3, Reg::R1, 0)
            .alu32_imm(AluOp::Rsh, Reg::R3, 16)
            .load(Size::W, Reg::R4, Reg::R1, 4)
            .load(Size::W, Reg::R5, Reg::R1, 8);
        for (n, (major, minor)) in deny.iter().enumerate() {
            let next = format!("next{n}");
            a.jmp_imm(JmpOp::Ne, Reg::R2, 2, &next)
                .jmp_imm(JmpOp::Ne, Reg::R4, *major as i32, &next)
                .jmp_imm(JmpOp::Ne, Reg::R5, *minor as i32, &next)
                .mov64_imm(Reg::R0, 0)
                .exit()
                .label(&next);
        }
        a.mov64_imm(Reg::R0, 1).exit();
        a.assemble().unwrap().insns
    }

    #[test]
    fn a_slurm_program_is_known_by_its_shape_and_evaluated_exactly() {
        let p = slurm_program(&[(195, 1), (195, 2)]);
        assert!(slurm_shaped(&p));
        assert_eq!(answer(&p, DevNum::new(195, 0), Access::RW), Answer::Allows);
        assert_eq!(answer(&p, DevNum::new(195, 1), Access::RW), Answer::Denies);
        assert_eq!(
            answer(&p, DevNum::new(195, 2), Access::READ),
            Answer::Denies
        );
        assert_eq!(answer(&p, DevNum::new(1, 3), Access::RW), Answer::Allows);
        // Cut short, or with an extra instruction: not Slurm's shape.
        assert!(!slurm_shaped(&p[..p.len() - 1]));
        let mut q = p.clone();
        q.insert(6, q[6]);
        q.insert(6, q[6]);
        q.insert(6, q[6]);
        assert!(!slurm_shaped(&q), "four checks in a block");
        let mut a = Asm::new();
        a.mov64_imm(Reg::R0, 1).exit();
        assert!(!slurm_shaped(&a.assemble().unwrap().insns));
    }

    #[test]
    fn a_program_that_reads_a_map_or_calls_the_kernel_may_deny() {
        let mut a = Asm::new();
        a.call(crate::asm::Helper::GetCurrentUidGid)
            .mov64_imm(Reg::R0, 1)
            .exit();
        assert!(matches!(
            answer(&a.assemble().unwrap().insns, DevNum::new(195, 0), Access::RW),
            Answer::MayDeny(w) if w.contains("calls the kernel")
        ));
        let mut a = Asm::new();
        a.ld_map_fd(Reg::R1, 3, "m").mov64_imm(Reg::R0, 1).exit();
        assert!(matches!(
            answer(&a.assemble().unwrap().insns, DevNum::new(195, 0), Access::RW),
            Answer::MayDeny(w) if w.contains("reads a map")
        ));
        assert!(matches!(
            answer(&[], DevNum::new(195, 0), Access::RW),
            Answer::MayDeny(_)
        ));
        let mut a = Asm::new();
        a.mov64_imm(Reg::R0, 0).exit();
        assert_eq!(
            answer(
                &a.assemble().unwrap().insns,
                DevNum::new(195, 0),
                Access::RW
            ),
            Answer::Denies
        );
    }
}
