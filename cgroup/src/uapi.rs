//! The numbers of the kernel's BPF interface this crate uses, each said
//! once, here: `bpf(2)` commands, program, attach, link and map types,
//! flags, the fields of an instruction's opcode, and helper ids
//! (`include/uapi/linux/bpf.h` and `bpf_common.h`). The syscall wrappers
//! ([`crate::sys`]), the assembler ([`crate::asm`]), the interpreter
//! ([`crate::interp`]), the map layouts ([`crate::maps`]) and the
//! programs name them from here; none writes a number of its own.

/// `enum bpf_cmd`: the first argument of `bpf(2)`.
pub mod cmd {
    /// `BPF_MAP_CREATE`.
    pub const MAP_CREATE: i32 = 0;
    /// `BPF_MAP_LOOKUP_ELEM`.
    pub const MAP_LOOKUP_ELEM: i32 = 1;
    /// `BPF_MAP_UPDATE_ELEM`.
    pub const MAP_UPDATE_ELEM: i32 = 2;
    /// `BPF_MAP_DELETE_ELEM`.
    pub const MAP_DELETE_ELEM: i32 = 3;
    /// `BPF_MAP_GET_NEXT_KEY`.
    pub const MAP_GET_NEXT_KEY: i32 = 4;
    /// `BPF_PROG_LOAD`.
    pub const PROG_LOAD: i32 = 5;
    /// `BPF_OBJ_PIN`.
    pub const OBJ_PIN: i32 = 6;
    /// `BPF_OBJ_GET`.
    pub const OBJ_GET: i32 = 7;
    /// `BPF_PROG_ATTACH`.
    pub const PROG_ATTACH: i32 = 8;
    /// `BPF_PROG_DETACH`.
    pub const PROG_DETACH: i32 = 9;
    /// `BPF_PROG_GET_FD_BY_ID`.
    pub const PROG_GET_FD_BY_ID: i32 = 13;
    /// `BPF_MAP_GET_FD_BY_ID`.
    pub const MAP_GET_FD_BY_ID: i32 = 14;
    /// `BPF_OBJ_GET_INFO_BY_FD`.
    pub const OBJ_GET_INFO_BY_FD: i32 = 15;
    /// `BPF_PROG_QUERY`.
    pub const PROG_QUERY: i32 = 16;
    /// `BPF_BTF_LOAD`.
    pub const BTF_LOAD: i32 = 18;
    /// `BPF_MAP_LOOKUP_BATCH`.
    pub const MAP_LOOKUP_BATCH: i32 = 24;
    /// `BPF_LINK_CREATE`.
    pub const LINK_CREATE: i32 = 28;
    /// `BPF_LINK_UPDATE`.
    pub const LINK_UPDATE: i32 = 29;
    /// `BPF_ITER_CREATE`.
    pub const ITER_CREATE: i32 = 33;
    /// `BPF_LINK_DETACH`.
    pub const LINK_DETACH: i32 = 34;
}

/// `enum bpf_map_type`: the types the fence makes, and those whose
/// values are per CPU (a raw call refuses them, `crate::sys::MapFd`).
pub mod map_type {
    /// `BPF_MAP_TYPE_HASH`.
    pub const HASH: u32 = 1;
    /// `BPF_MAP_TYPE_ARRAY`.
    pub const ARRAY: u32 = 2;
    /// `BPF_MAP_TYPE_PERCPU_HASH`.
    pub const PERCPU_HASH: u32 = 5;
    /// `BPF_MAP_TYPE_PERCPU_ARRAY`.
    pub const PERCPU_ARRAY: u32 = 6;
    /// `BPF_MAP_TYPE_LRU_HASH`: a full map evicts the least recently used
    /// entry.
    pub const LRU_HASH: u32 = 9;
    /// `BPF_MAP_TYPE_LRU_PERCPU_HASH`.
    pub const LRU_PERCPU_HASH: u32 = 10;
    /// `BPF_MAP_TYPE_PERCPU_CGROUP_STORAGE`.
    pub const PERCPU_CGROUP_STORAGE: u32 = 21;
    /// The per-CPU types: their values cross the syscall as one copy per
    /// possible CPU, each rounded up to 8 bytes (`bpf_map_value_size` in
    /// `kernel/bpf/syscall.c`), not `value_size` bytes.
    pub const PERCPU: [u32; 4] = [
        PERCPU_HASH,
        PERCPU_ARRAY,
        LRU_PERCPU_HASH,
        PERCPU_CGROUP_STORAGE,
    ];
}

/// `BPF_PROG_TYPE_CGROUP_DEVICE` (`enum bpf_prog_type`).
pub const PROG_TYPE_CGROUP_DEVICE: u32 = 15;
/// `BPF_PROG_TYPE_TRACING`.
pub const PROG_TYPE_TRACING: u32 = 26;
/// `BPF_CGROUP_DEVICE` (`enum bpf_attach_type`).
pub const ATTACH_CGROUP_DEVICE: u32 = 6;
/// `BPF_TRACE_ITER` (`enum bpf_attach_type`).
pub const ATTACH_TRACE_ITER: u32 = 28;
/// `BPF_LINK_TYPE_CGROUP` (`enum bpf_link_type`).
pub const LINK_TYPE_CGROUP: u32 = 3;
/// `BPF_ANY` for map updates.
pub const UPDATE_ANY: u64 = 0;
/// `BPF_F_ALLOW_OVERRIDE`.
pub const F_ALLOW_OVERRIDE: u32 = 1 << 0;
/// `BPF_F_ALLOW_MULTI` as reported in query attach flags.
pub const F_ALLOW_MULTI: u32 = 1 << 1;
/// `BPF_F_QUERY_EFFECTIVE`.
pub const F_QUERY_EFFECTIVE: u32 = 1;
/// `BPF_CGROUP_ITER_SELF_ONLY` (`enum bpf_cgroup_iter_order`): the
/// program runs for the start cgroup only.
pub const CGROUP_ITER_SELF_ONLY: u32 = 1;
/// `BPF_CGROUP_ITER_ANCESTORS_UP`: the start cgroup, then each parent up to
/// the root of the hierarchy (`cgroup_iter_seq_next`: `curr->parent`,
/// whatever cgroup namespace the reader is in).
pub const CGROUP_ITER_ANCESTORS_UP: u32 = 4;
/// `BPF_DEVCG_DEV_CHAR`: the device type of a character device in
/// `bpf_cgroup_dev_ctx.access_type`.
pub const DEVCG_DEV_CHAR: i32 = 2;

/// `BPF_PSEUDO_MAP_FD`: `src_reg` of a `ld_imm64` whose immediate is a map fd.
pub const PSEUDO_MAP_FD: u8 = 1;
/// `BPF_PSEUDO_KFUNC_CALL`: `src_reg` of a call whose immediate is a
/// kernel function's BTF id.
pub const PSEUDO_KFUNC_CALL: u8 = 2;
/// `BPF_PSEUDO_FUNC`: `src_reg` of a `ld_imm64` whose immediate is the
/// offset, in instructions, from the instruction after it to a subprogram
/// (`find_subprog(env, i + insn->imm + 1)`, `kernel/bpf/verifier.c`): a
/// callback for helpers such as `bpf_loop`.
pub const PSEUDO_FUNC: u8 = 4;

/// The fields of an instruction's opcode byte (`bpf_common.h`, `bpf.h`):
/// class (low 3 bits), then size and mode for loads and stores, or source
/// and operation for arithmetic and jumps.
pub mod opcode {
    /// `BPF_LD`.
    pub const CLASS_LD: u8 = 0x00;
    /// `BPF_LDX`.
    pub const CLASS_LDX: u8 = 0x01;
    /// `BPF_ST`.
    pub const CLASS_ST: u8 = 0x02;
    /// `BPF_STX`.
    pub const CLASS_STX: u8 = 0x03;
    /// `BPF_ALU` (32 bits).
    pub const CLASS_ALU: u8 = 0x04;
    /// `BPF_JMP`.
    pub const CLASS_JMP: u8 = 0x05;
    /// `BPF_ALU64`.
    pub const CLASS_ALU64: u8 = 0x07;
    /// The class bits (`BPF_CLASS`).
    pub const CLASS_MASK: u8 = 0x07;

    /// `BPF_W`: 4 bytes.
    pub const SIZE_W: u8 = 0x00;
    /// `BPF_H`: 2 bytes.
    pub const SIZE_H: u8 = 0x08;
    /// `BPF_B`: 1 byte.
    pub const SIZE_B: u8 = 0x10;
    /// `BPF_DW`: 8 bytes.
    pub const SIZE_DW: u8 = 0x18;
    /// The size bits (`BPF_SIZE`).
    pub const SIZE_MASK: u8 = 0x18;

    /// `BPF_IMM`.
    pub const MODE_IMM: u8 = 0x00;
    /// `BPF_MEM`.
    pub const MODE_MEM: u8 = 0x60;
    /// `BPF_ATOMIC`.
    pub const MODE_ATOMIC: u8 = 0xc0;
    /// The mode bits (`BPF_MODE`).
    pub const MODE_MASK: u8 = 0xe0;
    /// `BPF_ADD` as the immediate of an atomic instruction.
    pub const ATOMIC_ADD: i32 = 0x00;
    /// `BPF_LD | BPF_IMM | BPF_DW`: the 64-bit immediate load (two slots).
    pub const LD_IMM64: u8 = CLASS_LD | MODE_IMM | SIZE_DW;

    /// `BPF_K`: the operand is the immediate.
    pub const SRC_K: u8 = 0x00;
    /// `BPF_X`: the operand is `src_reg`.
    pub const SRC_X: u8 = 0x08;
    /// The operation bits (`BPF_OP`).
    pub const OP_MASK: u8 = 0xf0;

    /// `BPF_ADD`.
    pub const ALU_ADD: u8 = 0x00;
    /// `BPF_SUB`.
    pub const ALU_SUB: u8 = 0x10;
    /// `BPF_OR`.
    pub const ALU_OR: u8 = 0x40;
    /// `BPF_AND`.
    pub const ALU_AND: u8 = 0x50;
    /// `BPF_LSH`.
    pub const ALU_LSH: u8 = 0x60;
    /// `BPF_RSH`.
    pub const ALU_RSH: u8 = 0x70;
    /// `BPF_MOD`.
    pub const ALU_MOD: u8 = 0x90;
    /// `BPF_XOR`.
    pub const ALU_XOR: u8 = 0xa0;
    /// `BPF_MOV`.
    pub const ALU_MOV: u8 = 0xb0;

    /// `BPF_JA`.
    pub const JMP_JA: u8 = 0x00;
    /// `BPF_JEQ`.
    pub const JMP_JEQ: u8 = 0x10;
    /// `BPF_JGT`.
    pub const JMP_JGT: u8 = 0x20;
    /// `BPF_JGE`.
    pub const JMP_JGE: u8 = 0x30;
    /// `BPF_JSET`.
    pub const JMP_JSET: u8 = 0x40;
    /// `BPF_JNE`.
    pub const JMP_JNE: u8 = 0x50;
    /// `BPF_CALL`.
    pub const JMP_CALL: u8 = 0x80;
    /// `BPF_EXIT`.
    pub const JMP_EXIT: u8 = 0x90;
    /// `BPF_JLT`.
    pub const JMP_JLT: u8 = 0xa0;
    /// `BPF_JLE`.
    pub const JMP_JLE: u8 = 0xb0;
}

/// `enum bpf_func_id`: the helpers the programs call.
pub mod helper {
    /// `bpf_map_lookup_elem(map, key) -> value ptr or NULL`.
    pub const MAP_LOOKUP_ELEM: i32 = 1;
    /// `bpf_map_update_elem(map, key, value, flags)`.
    pub const MAP_UPDATE_ELEM: i32 = 2;
    /// `bpf_ktime_get_ns()`.
    pub const KTIME_GET_NS: i32 = 5;
    /// `bpf_get_current_pid_tgid()`.
    pub const GET_CURRENT_PID_TGID: i32 = 14;
    /// `bpf_get_current_uid_gid()`.
    pub const GET_CURRENT_UID_GID: i32 = 15;
    /// `bpf_get_current_comm(buf, size)`.
    pub const GET_CURRENT_COMM: i32 = 16;
    /// `bpf_get_current_cgroup_id()`.
    pub const GET_CURRENT_CGROUP_ID: i32 = 80;
    /// `bpf_probe_read_kernel(dst, size, unsafe_ptr)`.
    pub const PROBE_READ_KERNEL: i32 = 113;
    /// `bpf_get_current_ancestor_cgroup_id(level)`: 0 past the task's depth.
    pub const GET_CURRENT_ANCESTOR_CGROUP_ID: i32 = 123;
    /// `long bpf_seq_write(struct seq_file *m, const void *data, u32 len)`.
    pub const SEQ_WRITE: i32 = 127;
    /// `long bpf_loop(u32 nr_loops, void *callback_fn, void *callback_ctx,
    /// u64 flags)` (5.17+), at most `BPF_MAX_LOOPS` calls.
    pub const LOOP: i32 = 181;
}
