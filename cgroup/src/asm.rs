//! A small typed eBPF assembler.
//!
//! Instructions are plain values; jumps name labels that [`Asm::assemble`]
//! resolves in one pass (an unknown or duplicate label, or a jump that does
//! not fit the 16-bit offset, is an [`AsmError`]). [`Asm::comment`] adds a
//! line to the text listing without emitting code, so each block can carry
//! the pseudo-C it implements. Encodings are the kernel's
//! ([`crate::uapi::opcode`]).

use std::collections::HashMap;
use std::fmt::{self, Write as _};

use crate::uapi::opcode::*;
use crate::uapi::{helper, PSEUDO_FUNC, PSEUDO_KFUNC_CALL, PSEUDO_MAP_FD};

/// A register. `R0` return value, `R1`..`R5` arguments (clobbered by calls),
/// `R6`..`R9` callee-saved, `R10` read-only frame pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum Reg {
    R0 = 0,
    R1,
    R2,
    R3,
    R4,
    R5,
    R6,
    R7,
    R8,
    R9,
    R10,
}

impl fmt::Display for Reg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", *self as u8)
    }
}

/// Memory access width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// 1 byte (`BPF_B` = 0x10).
    B,
    /// 2 bytes (`BPF_H` = 0x08).
    H,
    /// 4 bytes (`BPF_W` = 0x00).
    W,
    /// 8 bytes (`BPF_DW` = 0x18).
    DW,
}

impl Size {
    fn code(self) -> u8 {
        match self {
            Size::W => SIZE_W,
            Size::H => SIZE_H,
            Size::B => SIZE_B,
            Size::DW => SIZE_DW,
        }
    }
    fn c_type(self) -> &'static str {
        match self {
            Size::B => "u8",
            Size::H => "u16",
            Size::W => "u32",
            Size::DW => "u64",
        }
    }
}

/// ALU operations (`BPF_ADD`..`BPF_MOV`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum AluOp {
    Add,
    Sub,
    Or,
    And,
    Lsh,
    Rsh,
    /// Unsigned remainder (`BPF_MOD`; by 0 the kernel leaves `dst` as it is).
    Mod,
    Xor,
    Mov,
}

impl AluOp {
    fn code(self) -> u8 {
        match self {
            AluOp::Add => ALU_ADD,
            AluOp::Sub => ALU_SUB,
            AluOp::Or => ALU_OR,
            AluOp::And => ALU_AND,
            AluOp::Lsh => ALU_LSH,
            AluOp::Rsh => ALU_RSH,
            AluOp::Mod => ALU_MOD,
            AluOp::Xor => ALU_XOR,
            AluOp::Mov => ALU_MOV,
        }
    }
    fn sym(self) -> &'static str {
        match self {
            AluOp::Add => "+=",
            AluOp::Sub => "-=",
            AluOp::Or => "|=",
            AluOp::And => "&=",
            AluOp::Lsh => "<<=",
            AluOp::Rsh => ">>=",
            AluOp::Mod => "%=",
            AluOp::Xor => "^=",
            AluOp::Mov => "=",
        }
    }
}

/// Conditional jump operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum JmpOp {
    Eq,
    Ne,
    Gt,
    Ge,
    Lt,
    Le,
    /// `dst & src != 0`.
    Set,
}

impl JmpOp {
    fn code(self) -> u8 {
        match self {
            JmpOp::Eq => JMP_JEQ,
            JmpOp::Gt => JMP_JGT,
            JmpOp::Ge => JMP_JGE,
            JmpOp::Set => JMP_JSET,
            JmpOp::Ne => JMP_JNE,
            JmpOp::Lt => JMP_JLT,
            JmpOp::Le => JMP_JLE,
        }
    }
    fn sym(self) -> &'static str {
        match self {
            JmpOp::Eq => "==",
            JmpOp::Ne => "!=",
            JmpOp::Gt => ">",
            JmpOp::Ge => ">=",
            JmpOp::Lt => "<",
            JmpOp::Le => "<=",
            JmpOp::Set => "&",
        }
    }
}

/// Helper functions the fence calls (`enum bpf_func_id`, `include/uapi/linux/bpf.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Helper {
    /// `bpf_map_lookup_elem(map, key) -> value ptr or NULL` (1).
    MapLookupElem,
    /// `bpf_map_update_elem(map, key, value, flags)` (2).
    MapUpdateElem,
    /// `bpf_ktime_get_ns()` (5).
    KtimeGetNs,
    /// `bpf_get_current_pid_tgid()` (14).
    GetCurrentPidTgid,
    /// `bpf_get_current_uid_gid()` (15).
    GetCurrentUidGid,
    /// `bpf_get_current_comm(buf, size)` (16).
    GetCurrentComm,
    /// `bpf_get_current_cgroup_id()` (80).
    GetCurrentCgroupId,
    /// `bpf_get_current_ancestor_cgroup_id(level)` (123): 0 past the task's depth.
    GetCurrentAncestorCgroupId,
}

impl Helper {
    /// The helper's number.
    pub const fn id(self) -> i32 {
        match self {
            Helper::MapLookupElem => helper::MAP_LOOKUP_ELEM,
            Helper::MapUpdateElem => helper::MAP_UPDATE_ELEM,
            Helper::KtimeGetNs => helper::KTIME_GET_NS,
            Helper::GetCurrentPidTgid => helper::GET_CURRENT_PID_TGID,
            Helper::GetCurrentUidGid => helper::GET_CURRENT_UID_GID,
            Helper::GetCurrentComm => helper::GET_CURRENT_COMM,
            Helper::GetCurrentCgroupId => helper::GET_CURRENT_CGROUP_ID,
            Helper::GetCurrentAncestorCgroupId => helper::GET_CURRENT_ANCESTOR_CGROUP_ID,
        }
    }
    /// The helper's name without the `bpf_` prefix.
    pub const fn name(self) -> &'static str {
        match self {
            Helper::MapLookupElem => "map_lookup_elem",
            Helper::MapUpdateElem => "map_update_elem",
            Helper::KtimeGetNs => "ktime_get_ns",
            Helper::GetCurrentPidTgid => "get_current_pid_tgid",
            Helper::GetCurrentUidGid => "get_current_uid_gid",
            Helper::GetCurrentComm => "get_current_comm",
            Helper::GetCurrentCgroupId => "get_current_cgroup_id",
            Helper::GetCurrentAncestorCgroupId => "get_current_ancestor_cgroup_id",
        }
    }
    /// The helper with number `id`, if the assembler knows it.
    pub fn from_id(id: i32) -> Option<Helper> {
        [
            Helper::MapLookupElem,
            Helper::MapUpdateElem,
            Helper::KtimeGetNs,
            Helper::GetCurrentPidTgid,
            Helper::GetCurrentUidGid,
            Helper::GetCurrentComm,
            Helper::GetCurrentCgroupId,
            Helper::GetCurrentAncestorCgroupId,
        ]
        .into_iter()
        .find(|h| h.id() == id)
    }
}

/// One encoded instruction, as `struct bpf_insn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(C)]
pub struct RawInsn {
    /// Opcode.
    pub code: u8,
    /// `dst_reg` in the low nibble, `src_reg` in the high nibble.
    pub regs: u8,
    /// Signed offset (memory or jump).
    pub off: i16,
    /// Signed immediate.
    pub imm: i32,
}

impl RawInsn {
    /// The destination register number.
    pub fn dst(&self) -> u8 {
        self.regs & 0x0f
    }
    /// The source register number.
    pub fn src(&self) -> u8 {
        self.regs >> 4
    }
}

#[derive(Clone, Debug)]
enum Item {
    Insn(RawInsn, String),
    /// `ld_imm64` of a map fd: two slots.
    LdMap {
        dst: Reg,
        fd: i32,
        name: String,
    },
    Jump {
        code: u8,
        dst: Reg,
        src: Reg,
        imm: i32,
        label: String,
        text: String,
    },
    /// `ld_imm64` of a subprogram's address: two slots.
    LdFunc {
        dst: Reg,
        label: String,
    },
    Label(String),
    Comment(String),
}

/// An assembly error: always a bug in the program builder.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AsmError {
    /// A jump names a label that is never defined.
    #[error("jump to undefined label {0:?}")]
    UndefinedLabel(String),
    /// A label is defined twice.
    #[error("label {0:?} defined twice")]
    DuplicateLabel(String),
    /// A jump is farther than a 16-bit offset reaches.
    #[error("jump to {0:?} is out of range")]
    OutOfRange(String),
    /// The fence program's exempt identities do not fit its compare
    /// immediates (`program::build`).
    #[error(
        "exempt identities out of range (uids at most 2147483647, at most 16 service uids): {0}"
    )]
    Identities(String),
}

/// `MAX_BPF_STACK` (`include/linux/filter.h`): the bytes of stack one BPF
/// frame may use below its frame pointer `r10`.
pub const MAX_STACK: usize = 512;

/// The offset from the frame pointer (`r10`) of a stack slot. A program's
/// frame is laid out as a `#[repr(C)]` struct of `frame` bytes whose end
/// is `r10` (the stack grows down from it); its member at byte `offset`
/// is then at `r10 - frame + offset`. [`fp_slot!`](crate::fp_slot) names
/// the member instead of the number.
///
/// # Panics
/// At compile time, where a const uses it: a frame past [`MAX_STACK`], not
/// a whole number of 8-byte words (`r10` is 8-byte aligned), or an offset
/// outside it.
pub const fn fp_offset(offset: usize, frame: usize) -> i16 {
    assert!(frame <= MAX_STACK, "a BPF frame holds at most 512 bytes");
    assert!(frame.is_multiple_of(8), "a BPF frame is whole 8-byte words");
    assert!(offset <= frame, "a slot inside its frame");
    offset as i16 - frame as i16
}

/// The `r10`-relative offset ([`fp_offset`]) of member `$field` (a path:
/// `state.seq`) of the `#[repr(C)]` stack frame struct `$frame`, for a
/// const: `const SEQ: i16 = fp_slot!(Frame, state.seq);`.
#[macro_export]
macro_rules! fp_slot {
    ($frame:ty, $($field:tt).+) => {
        $crate::asm::fp_offset(
            ::core::mem::offset_of!($frame, $($field).+),
            ::core::mem::size_of::<$frame>(),
        )
    };
}

/// The assembled program: the instructions and their annotated listing.
#[derive(Clone, Debug)]
pub struct Program {
    /// Instructions ready for `BPF_PROG_LOAD`.
    pub insns: Vec<RawInsn>,
    /// One line per instruction, comment or label; stable, for golden tests.
    pub listing: String,
}

impl Program {
    /// A stable fingerprint of the program's bytes: its instruction count
    /// and the 64-bit FNV-1a hash of each instruction's encoding (code,
    /// registers, little-endian offset and immediate). Tests record it to
    /// check that a refactor emits the same program.
    pub fn fingerprint(&self) -> (usize, u64) {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for i in &self.insns {
            let mut b = vec![i.code, i.regs];
            b.extend_from_slice(&i.off.to_le_bytes());
            b.extend_from_slice(&i.imm.to_le_bytes());
            for x in b {
                h ^= u64::from(x);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        (self.insns.len(), h)
    }
}

/// The assembler: push instructions, then [`Asm::assemble`].
#[derive(Clone, Debug, Default)]
pub struct Asm {
    items: Vec<Item>,
}

impl Asm {
    /// An empty program.
    pub fn new() -> Self {
        Self::default()
    }

    fn push(
        &mut self,
        code: u8,
        dst: Reg,
        src: Reg,
        off: i16,
        imm: i32,
        text: String,
    ) -> &mut Self {
        self.items.push(Item::Insn(
            RawInsn {
                code,
                regs: (dst as u8) | ((src as u8) << 4),
                off,
                imm,
            },
            text,
        ));
        self
    }

    /// A listing line with no code: the pseudo-C of the block that follows.
    pub fn comment(&mut self, text: &str) -> &mut Self {
        self.items.push(Item::Comment(text.to_string()));
        self
    }

    /// Defines `name` at the next instruction.
    pub fn label(&mut self, name: &str) -> &mut Self {
        self.items.push(Item::Label(name.to_string()));
        self
    }

    /// `dst op= imm` on 64 bits.
    pub fn alu64_imm(&mut self, op: AluOp, dst: Reg, imm: i32) -> &mut Self {
        self.push(
            CLASS_ALU64 | op.code() | SRC_K,
            dst,
            Reg::R0,
            0,
            imm,
            format!("{dst} {} {imm}", op.sym()),
        )
    }

    /// `dst op= src` on 64 bits.
    pub fn alu64_reg(&mut self, op: AluOp, dst: Reg, src: Reg) -> &mut Self {
        self.push(
            CLASS_ALU64 | op.code() | SRC_X,
            dst,
            src,
            0,
            0,
            format!("{dst} {} {src}", op.sym()),
        )
    }

    /// `dst op= imm` on 32 bits (the upper half of `dst` is zeroed).
    pub fn alu32_imm(&mut self, op: AluOp, dst: Reg, imm: i32) -> &mut Self {
        self.push(
            CLASS_ALU | op.code() | SRC_K,
            dst,
            Reg::R0,
            0,
            imm,
            format!("w{} {} {imm}", dst as u8, op.sym()),
        )
    }

    /// `dst = imm` (64-bit, sign-extended).
    pub fn mov64_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.alu64_imm(AluOp::Mov, dst, imm)
    }

    /// `dst = src` (64-bit).
    pub fn mov64_reg(&mut self, dst: Reg, src: Reg) -> &mut Self {
        self.alu64_reg(AluOp::Mov, dst, src)
    }

    /// `dst = *(size *)(src + off)`.
    pub fn load(&mut self, size: Size, dst: Reg, src: Reg, off: i16) -> &mut Self {
        self.push(
            CLASS_LDX | MODE_MEM | size.code(),
            dst,
            src,
            off,
            0,
            format!("{dst} = *({} *)({src} {off:+})", size.c_type()),
        )
    }

    /// `*(size *)(dst + off) = src`.
    pub fn store(&mut self, size: Size, dst: Reg, off: i16, src: Reg) -> &mut Self {
        self.push(
            CLASS_STX | MODE_MEM | size.code(),
            dst,
            src,
            off,
            0,
            format!("*({} *)({dst} {off:+}) = {src}", size.c_type()),
        )
    }

    /// `*(size *)(dst + off) = imm`.
    pub fn store_imm(&mut self, size: Size, dst: Reg, off: i16, imm: i32) -> &mut Self {
        self.push(
            CLASS_ST | MODE_MEM | size.code(),
            dst,
            Reg::R0,
            off,
            imm,
            format!("*({} *)({dst} {off:+}) = {imm}", size.c_type()),
        )
    }

    /// `lock *(u64 *)(dst + off) += src` (`BPF_STX | BPF_ATOMIC | BPF_DW`,
    /// imm `BPF_ADD`): a counter in a map value that concurrent CPUs share.
    pub fn atomic_add64(&mut self, dst: Reg, off: i16, src: Reg) -> &mut Self {
        self.push(
            CLASS_STX | MODE_ATOMIC | Size::DW.code(),
            dst,
            src,
            off,
            ATOMIC_ADD,
            format!("lock *(u64 *)({dst} {off:+}) += {src}"),
        )
    }

    /// `dst = &map` (`ld_imm64` with `BPF_PSEUDO_MAP_FD`); `name` is for the listing.
    pub fn ld_map_fd(&mut self, dst: Reg, fd: i32, name: &str) -> &mut Self {
        self.items.push(Item::LdMap {
            dst,
            fd,
            name: name.to_string(),
        });
        self
    }

    /// `dst = &subprogram at label` (`ld_imm64` with `BPF_PSEUDO_FUNC`): a
    /// callback for `bpf_loop`. The subprogram is code after the main
    /// program's last `exit`, ending in its own `exit`.
    pub fn ld_func(&mut self, dst: Reg, label: &str) -> &mut Self {
        self.items.push(Item::LdFunc {
            dst,
            label: label.to_string(),
        });
        self
    }

    /// `goto label`.
    pub fn ja(&mut self, label: &str) -> &mut Self {
        self.items.push(Item::Jump {
            code: CLASS_JMP | JMP_JA,
            dst: Reg::R0,
            src: Reg::R0,
            imm: 0,
            label: label.to_string(),
            text: format!("goto {label}"),
        });
        self
    }

    /// `if dst op imm goto label` (64-bit compare).
    pub fn jmp_imm(&mut self, op: JmpOp, dst: Reg, imm: i32, label: &str) -> &mut Self {
        self.items.push(Item::Jump {
            code: CLASS_JMP | op.code() | SRC_K,
            dst,
            src: Reg::R0,
            imm,
            label: label.to_string(),
            text: format!("if {dst} {} {imm} goto {label}", op.sym()),
        });
        self
    }

    /// `if dst op src goto label` (64-bit compare).
    pub fn jmp_reg(&mut self, op: JmpOp, dst: Reg, src: Reg, label: &str) -> &mut Self {
        self.items.push(Item::Jump {
            code: CLASS_JMP | op.code() | SRC_X,
            dst,
            src,
            imm: 0,
            label: label.to_string(),
            text: format!("if {dst} {} {src} goto {label}", op.sym()),
        });
        self
    }

    /// `r0 = helper(r1, ..., r5)`; clobbers r1-r5.
    pub fn call(&mut self, h: Helper) -> &mut Self {
        self.push(
            CLASS_JMP | JMP_CALL,
            Reg::R0,
            Reg::R0,
            0,
            h.id(),
            format!("call {}", h.name()),
        )
    }

    /// `return r0`.
    pub fn exit(&mut self) -> &mut Self {
        self.push(
            CLASS_JMP | JMP_EXIT,
            Reg::R0,
            Reg::R0,
            0,
            0,
            "exit".to_string(),
        )
    }

    /// Resolves labels and encodes.
    ///
    /// # Errors
    /// [`AsmError`] for an undefined or duplicate label or an out-of-range jump.
    pub fn assemble(&self) -> Result<Program, AsmError> {
        // Pass 1: slot of every label.
        let mut labels = HashMap::new();
        let mut pc = 0usize;
        for item in &self.items {
            match item {
                Item::Label(l) => {
                    if labels.insert(l.clone(), pc).is_some() {
                        return Err(AsmError::DuplicateLabel(l.clone()));
                    }
                }
                Item::Comment(_) => {}
                Item::LdMap { .. } | Item::LdFunc { .. } => pc += 2,
                Item::Insn(..) | Item::Jump { .. } => pc += 1,
            }
        }
        // Pass 2: encode.
        let mut insns = Vec::with_capacity(pc);
        let mut listing = String::new();
        for item in &self.items {
            match item {
                Item::Comment(c) => {
                    let _ = writeln!(listing, "      ; {c}");
                }
                Item::Label(l) => {
                    let _ = writeln!(listing, "{l}:");
                }
                Item::Insn(raw, text) => {
                    let _ = writeln!(listing, "{:4}: {text}", insns.len());
                    insns.push(*raw);
                }
                Item::LdMap { dst, fd, name } => {
                    let _ = writeln!(listing, "{:4}: {dst} = map[{name}]", insns.len());
                    insns.push(RawInsn {
                        code: CLASS_LD | MODE_IMM | Size::DW.code(),
                        regs: (*dst as u8) | (PSEUDO_MAP_FD << 4),
                        off: 0,
                        imm: *fd,
                    });
                    insns.push(RawInsn::default());
                }
                Item::LdFunc { dst, label } => {
                    let target = *labels
                        .get(label)
                        .ok_or_else(|| AsmError::UndefinedLabel(label.clone()))?;
                    let imm = i32::try_from(target as i64 - (insns.len() as i64 + 1))
                        .map_err(|_| AsmError::OutOfRange(label.clone()))?;
                    let _ = writeln!(listing, "{:4}: {dst} = func[{label}]", insns.len());
                    insns.push(RawInsn {
                        code: CLASS_LD | MODE_IMM | Size::DW.code(),
                        regs: (*dst as u8) | (PSEUDO_FUNC << 4),
                        off: 0,
                        imm,
                    });
                    insns.push(RawInsn::default());
                }
                Item::Jump {
                    code,
                    dst,
                    src,
                    imm,
                    label,
                    text,
                } => {
                    let target = *labels
                        .get(label)
                        .ok_or_else(|| AsmError::UndefinedLabel(label.clone()))?;
                    let off = target as i64 - (insns.len() as i64 + 1);
                    let off =
                        i16::try_from(off).map_err(|_| AsmError::OutOfRange(label.clone()))?;
                    let _ = writeln!(listing, "{:4}: {text}", insns.len());
                    insns.push(RawInsn {
                        code: *code,
                        regs: (*dst as u8) | ((*src as u8) << 4),
                        off,
                        imm: *imm,
                    });
                }
            }
        }
        Ok(Program { insns, listing })
    }
}

impl Asm {
    /// `call` of the kernel function whose `BTF_KIND_FUNC` id in vmlinux
    /// BTF is `btf_id` (`src_reg = BPF_PSEUDO_KFUNC_CALL`,
    /// `include/uapi/linux/bpf.h`). Clobbers r1-r5.
    pub fn call_kfunc(&mut self, btf_id: u32, name: &str) -> &mut Self {
        self.items.push(Item::Insn(
            RawInsn {
                code: CLASS_JMP | JMP_CALL,
                regs: PSEUDO_KFUNC_CALL << 4,
                off: 0,
                imm: btf_id as i32,
            },
            format!("call {name} (kfunc)"),
        ));
        self
    }

    /// `r0 = helper(r1, ..., r5)` by number, for helpers outside [`Helper`]
    /// (which lists those the fence and the interpreter know): e.g.
    /// `bpf_seq_write` (127) in an iterator program. `name` is for the
    /// listing. Clobbers r1-r5.
    pub fn call_id(&mut self, id: i32, name: &str) -> &mut Self {
        self.push(
            CLASS_JMP | JMP_CALL,
            Reg::R0,
            Reg::R0,
            0,
            id,
            format!("call {name}"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_like_the_kernel_macros() {
        let mut a = Asm::new();
        a.mov64_imm(Reg::R0, 1) // BPF_MOV64_IMM(R0, 1) = b7 00 .. 01
            .load(Size::W, Reg::R2, Reg::R1, 4) // BPF_LDX_MEM(W, R2, R1, 4) = 61 12 04 00
            .jmp_imm(JmpOp::Ne, Reg::R2, 195, "out")
            .ld_map_fd(Reg::R1, 7, "m")
            .call(Helper::GetCurrentAncestorCgroupId)
            .label("out")
            .exit();
        let p = a.assemble().unwrap();
        assert_eq!(
            p.insns[0],
            RawInsn {
                code: 0xb7,
                regs: 0x00,
                off: 0,
                imm: 1
            }
        );
        assert_eq!(
            p.insns[1],
            RawInsn {
                code: 0x61,
                regs: 0x12,
                off: 4,
                imm: 0
            }
        );
        // jne r2, 195, +3 (skips the 2-slot ld_imm64 and the call)
        assert_eq!(
            p.insns[2],
            RawInsn {
                code: 0x55,
                regs: 0x02,
                off: 3,
                imm: 195
            }
        );
        assert_eq!(
            p.insns[3],
            RawInsn {
                code: 0x18,
                regs: 0x11,
                off: 0,
                imm: 7
            }
        );
        assert_eq!(p.insns[4], RawInsn::default());
        assert_eq!(
            p.insns[5],
            RawInsn {
                code: 0x85,
                regs: 0,
                off: 0,
                imm: 123
            }
        );
        assert_eq!(
            p.insns[6],
            RawInsn {
                code: 0x95,
                regs: 0,
                off: 0,
                imm: 0
            }
        );
    }

    #[test]
    fn label_errors() {
        let mut a = Asm::new();
        a.ja("nowhere");
        assert_eq!(
            a.assemble().unwrap_err(),
            AsmError::UndefinedLabel("nowhere".into())
        );
        let mut a = Asm::new();
        a.label("x").label("x").exit();
        assert_eq!(
            a.assemble().unwrap_err(),
            AsmError::DuplicateLabel("x".into())
        );
        let mut a = Asm::new();
        a.ja("far");
        for _ in 0..40_000 {
            a.exit();
        }
        a.label("far").exit();
        assert_eq!(
            a.assemble().unwrap_err(),
            AsmError::OutOfRange("far".into())
        );
    }

    #[test]
    fn backward_jumps_resolve() {
        let mut a = Asm::new();
        a.label("top").mov64_imm(Reg::R0, 0).ja("top");
        let p = a.assemble().unwrap();
        assert_eq!(p.insns[1].off, -2);
    }
}
