//! An interpreter for the instructions the fence builder emits, so the
//! program can be run on synthetic `bpf_cgroup_dev_ctx` inputs and compared
//! with the plain-Rust policy ([`gpufence_model::policy`]) anywhere, without
//! a kernel. It covers exactly the subset [`crate::asm`] produces; anything
//! else is an [`InterpError`], never a guess. It is not a verifier: the
//! real verifier is exercised by the kernel tests.

use crate::asm::{Helper, RawInsn};
use crate::uapi::opcode::*;
use crate::uapi::PSEUDO_MAP_FD;

/// The world the program sees: map contents and the task's cgroup ancestry.
pub trait Env {
    /// Key size in bytes of the map with this fd; `None` for an unknown fd.
    fn key_size(&self, fd: i32) -> Option<usize>;
    /// Value size in bytes of the map with this fd (needed for updates).
    fn value_size(&self, _fd: i32) -> Option<usize> {
        None
    }
    /// `bpf_map_lookup_elem` on the map whose fd was loaded: the value bytes.
    fn map_lookup(&self, fd: i32, key: &[u8]) -> Option<Vec<u8>>;
    /// `bpf_get_current_ancestor_cgroup_id(level)`: 0 past the task's depth.
    fn ancestor_cgroup_id(&self, level: u64) -> u64;
    /// `bpf_map_update_elem`; returns the helper's result (0 on success).
    fn map_update(&self, _fd: i32, _key: &[u8], _value: &[u8]) -> i64 {
        0
    }
    /// `bpf_get_current_cgroup_id()`.
    fn cgroup_id(&self) -> u64 {
        0
    }
    /// `bpf_get_current_uid_gid()`: gid << 32 | uid.
    fn uid_gid(&self) -> u64 {
        0
    }
    /// `bpf_get_current_pid_tgid()`: tgid << 32 | pid.
    fn pid_tgid(&self) -> u64 {
        0
    }
    /// `bpf_get_current_comm()`: up to 16 bytes.
    fn comm(&self) -> [u8; 16] {
        [0; 16]
    }
    /// `bpf_ktime_get_ns()`.
    fn ktime_ns(&self) -> u64 {
        0
    }
}

/// A program the interpreter cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pc {pc}: {msg}")]
pub struct InterpError {
    /// Instruction index.
    pub pc: usize,
    /// What went wrong.
    pub msg: String,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Val {
    Scalar(u64),
    /// Pointer into region `region` at byte `off`.
    Ptr {
        region: usize,
        off: i64,
    },
    Map(i32),
}

const CTX: usize = 0;
const STACK: usize = 1;
const STACK_SIZE: i64 = 512;
const MAX_STEPS: usize = 100_000;

/// Runs `insns` with context `ctx` = `[access_type, major, minor]` and
/// returns `r0` at `exit`.
///
/// # Errors
/// [`InterpError`] for an instruction outside the supported subset, an
/// out-of-bounds access, arithmetic on pointers other than add/sub of
/// constants, or more than 100,000 steps.
pub fn run(insns: &[RawInsn], ctx: [u32; 3], env: &dyn Env) -> Result<u64, InterpError> {
    let mut regions: Vec<Vec<u8>> = vec![
        ctx.iter().flat_map(|v| v.to_ne_bytes()).collect(),
        vec![0u8; STACK_SIZE as usize],
    ];
    let mut r = [Val::Scalar(0); 11];
    r[1] = Val::Ptr {
        region: CTX,
        off: 0,
    };
    r[10] = Val::Ptr {
        region: STACK,
        off: STACK_SIZE,
    };
    let mut pc = 0usize;
    for _ in 0..MAX_STEPS {
        let err = |msg: String| InterpError { pc, msg };
        let i = *insns
            .get(pc)
            .ok_or_else(|| err("fell off the end".into()))?;
        let (dst, src) = (i.dst() as usize, i.src() as usize);
        if dst > 10 || src > 10 {
            return Err(err("bad register".into()));
        }
        let class = i.code & CLASS_MASK;
        match class {
            CLASS_ALU64 | CLASS_ALU => {
                let op = i.code & OP_MASK;
                let rhs = if i.code & SRC_X != 0 {
                    r[src]
                } else {
                    Val::Scalar(i.imm as i64 as u64)
                };
                let wide = class == CLASS_ALU64;
                r[dst] = alu(op, r[dst], rhs, wide).map_err(err)?;
                pc += 1;
            }
            CLASS_LDX => {
                let size = size_of_code(i.code).ok_or_else(|| err("bad size".into()))?;
                let v = read(&regions, r[src], i.off, size).map_err(err)?;
                r[dst] = Val::Scalar(v);
                pc += 1;
            }
            CLASS_STX if i.code & MODE_MASK == MODE_ATOMIC => {
                if i.imm != ATOMIC_ADD || size_of_code(i.code) != Some(8) {
                    return Err(err(format!("unsupported atomic {:#x}/{}", i.code, i.imm)));
                }
                let Val::Scalar(add) = r[src] else {
                    return Err(err("atomic add of a pointer".into()));
                };
                let old = read(&regions, r[dst], i.off, 8).map_err(err)?;
                write(&mut regions, r[dst], i.off, 8, old.wrapping_add(add)).map_err(err)?;
                pc += 1;
            }
            CLASS_STX | CLASS_ST => {
                let size = size_of_code(i.code).ok_or_else(|| err("bad size".into()))?;
                let v = if class == CLASS_STX {
                    match r[src] {
                        Val::Scalar(v) => v,
                        _ => return Err(err("storing a pointer".into())),
                    }
                } else {
                    i.imm as i64 as u64
                };
                if matches!(r[dst], Val::Ptr { region: CTX, .. }) {
                    return Err(err("store into the context".into()));
                }
                write(&mut regions, r[dst], i.off, size, v).map_err(err)?;
                pc += 1;
            }
            CLASS_LD => {
                if i.code != LD_IMM64 || i.src() != PSEUDO_MAP_FD {
                    return Err(err(format!("unsupported ld {:#x}", i.code)));
                }
                r[dst] = Val::Map(i.imm);
                pc += 2;
            }
            CLASS_JMP => {
                let op = i.code & OP_MASK;
                match op {
                    JMP_EXIT => {
                        return match r[0] {
                            Val::Scalar(v) => Ok(v),
                            _ => Err(err("returning a pointer".into())),
                        }
                    }
                    JMP_CALL => {
                        let h = Helper::from_id(i.imm)
                            .ok_or_else(|| err(format!("unknown helper {}", i.imm)))?;
                        r[0] = call(h, &r, &mut regions, env).map_err(err)?;
                        for reg in r.iter_mut().take(6).skip(1) {
                            *reg = Val::Scalar(0xdead_beef); // clobbered
                        }
                        pc += 1;
                    }
                    JMP_JA => pc = jump(pc, i.off).map_err(err)?,
                    _ => {
                        let lhs = r[dst];
                        let rhs = if i.code & SRC_X != 0 {
                            r[src]
                        } else {
                            Val::Scalar(i.imm as i64 as u64)
                        };
                        let taken = cond(op, lhs, rhs).map_err(err)?;
                        pc = if taken {
                            jump(pc, i.off).map_err(err)?
                        } else {
                            pc + 1
                        };
                    }
                }
            }
            _ => return Err(err(format!("unsupported class {class:#x}"))),
        }
    }
    Err(InterpError {
        pc,
        msg: "too many steps".into(),
    })
}

fn jump(pc: usize, off: i16) -> Result<usize, String> {
    usize::try_from(pc as i64 + 1 + off as i64).map_err(|_| "jump before start".to_string())
}

fn size_of_code(code: u8) -> Option<usize> {
    Some(match code & SIZE_MASK {
        SIZE_W => 4,
        SIZE_H => 2,
        SIZE_B => 1,
        SIZE_DW => 8,
        _ => return None,
    })
}

fn alu(op: u8, lhs: Val, rhs: Val, wide: bool) -> Result<Val, String> {
    if op == ALU_MOV {
        return Ok(match rhs {
            Val::Scalar(v) if !wide => Val::Scalar(v & 0xffff_ffff),
            other => other,
        });
    }
    match (lhs, rhs) {
        (Val::Scalar(a), Val::Scalar(b)) => {
            let v = match op {
                ALU_ADD => a.wrapping_add(b),
                ALU_SUB => a.wrapping_sub(b),
                ALU_OR => a | b,
                ALU_AND => a & b,
                ALU_LSH => a.wrapping_shl(b as u32),
                ALU_RSH => {
                    if wide {
                        a.wrapping_shr(b as u32)
                    } else {
                        ((a as u32).wrapping_shr(b as u32)) as u64
                    }
                }
                ALU_XOR => a ^ b,
                _ => return Err(format!("unsupported alu op {op:#x}")),
            };
            Ok(Val::Scalar(if wide { v } else { v & 0xffff_ffff }))
        }
        (Val::Ptr { region, off }, Val::Scalar(b)) if wide && (op == ALU_ADD || op == ALU_SUB) => {
            let d = b as i64;
            Ok(Val::Ptr {
                region,
                off: if op == ALU_ADD { off + d } else { off - d },
            })
        }
        _ => Err(format!("alu op {op:#x} on pointers")),
    }
}

fn cond(op: u8, lhs: Val, rhs: Val) -> Result<bool, String> {
    // A pointer compared with 0 is the NULL check after a map lookup.
    let (a, b) = match (lhs, rhs) {
        (Val::Scalar(a), Val::Scalar(b)) => (a, b),
        (Val::Ptr { .. }, Val::Scalar(0)) => (1, 0),
        _ => return Err("compare of non-scalars".into()),
    };
    Ok(match op {
        JMP_JEQ => a == b,
        JMP_JNE => a != b,
        JMP_JGT => a > b,
        JMP_JGE => a >= b,
        JMP_JLT => a < b,
        JMP_JLE => a <= b,
        JMP_JSET => a & b != 0,
        _ => return Err(format!("unsupported jump op {op:#x}")),
    })
}

fn bounds(regions: &[Vec<u8>], p: Val, off: i16, size: usize) -> Result<(usize, usize), String> {
    match p {
        Val::Ptr { region, off: base } => {
            let start = base + off as i64;
            let len = regions.get(region).map(Vec::len).ok_or("bad region")? as i64;
            if start < 0 || start + size as i64 > len {
                return Err(format!(
                    "access [{start}, +{size}) outside region {region} of {len} bytes"
                ));
            }
            Ok((region, start as usize))
        }
        _ => Err("memory access through a non-pointer".into()),
    }
}

fn read(regions: &[Vec<u8>], p: Val, off: i16, size: usize) -> Result<u64, String> {
    let (reg, start) = bounds(regions, p, off, size)?;
    let mut b = [0u8; 8];
    b[..size].copy_from_slice(&regions[reg][start..start + size]);
    Ok(u64::from_le_bytes(b))
}

fn write(regions: &mut [Vec<u8>], p: Val, off: i16, size: usize, v: u64) -> Result<(), String> {
    let (reg, start) = bounds(regions, p, off, size)?;
    regions[reg][start..start + size].copy_from_slice(&v.to_le_bytes()[..size]);
    Ok(())
}

fn call(
    h: Helper,
    r: &[Val; 11],
    regions: &mut Vec<Vec<u8>>,
    env: &dyn Env,
) -> Result<Val, String> {
    match h {
        Helper::GetCurrentAncestorCgroupId => match r[1] {
            Val::Scalar(level) => Ok(Val::Scalar(env.ancestor_cgroup_id(level))),
            _ => Err("level is not a scalar".into()),
        },
        Helper::MapLookupElem => {
            let Val::Map(fd) = r[1] else {
                return Err("r1 is not a map".into());
            };
            let Val::Ptr { region, off } = r[2] else {
                return Err("r2 is not a pointer".into());
            };
            let key_len = env
                .key_size(fd)
                .ok_or_else(|| format!("unknown map fd {fd}"))?;
            let start = usize::try_from(off).map_err(|_| "negative key")?;
            let key = regions
                .get(region)
                .ok_or("bad region")?
                .get(start..start + key_len)
                .ok_or("key out of bounds")?
                .to_vec();
            match env.map_lookup(fd, &key) {
                Some(v) => {
                    regions.push(v);
                    Ok(Val::Ptr {
                        region: regions.len() - 1,
                        off: 0,
                    })
                }
                None => Ok(Val::Scalar(0)),
            }
        }
        Helper::MapUpdateElem => {
            let Val::Map(fd) = r[1] else {
                return Err("r1 is not a map".into());
            };
            let key_len = env
                .key_size(fd)
                .ok_or_else(|| format!("unknown map fd {fd}"))?;
            let value_len = env
                .value_size(fd)
                .ok_or_else(|| format!("unknown map fd {fd}"))?;
            let (
                Val::Ptr {
                    region: kr,
                    off: ko,
                },
                Val::Ptr {
                    region: vr,
                    off: vo,
                },
            ) = (r[2], r[3])
            else {
                return Err("key/value are not pointers".into());
            };
            let get = |reg: usize, off: i64, len: usize| -> Result<Vec<u8>, String> {
                let start = usize::try_from(off).map_err(|_| "negative offset".to_string())?;
                regions
                    .get(reg)
                    .and_then(|m| m.get(start..start + len))
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| "key/value out of bounds".to_string())
            };
            let key = get(kr, ko, key_len)?;
            let value = get(vr, vo, value_len)?;
            Ok(Val::Scalar(env.map_update(fd, &key, &value) as u64))
        }
        Helper::GetCurrentCgroupId => Ok(Val::Scalar(env.cgroup_id())),
        Helper::GetCurrentUidGid => Ok(Val::Scalar(env.uid_gid())),
        Helper::GetCurrentPidTgid => Ok(Val::Scalar(env.pid_tgid())),
        Helper::KtimeGetNs => Ok(Val::Scalar(env.ktime_ns())),
        Helper::GetCurrentComm => {
            let Val::Ptr { region, off } = r[1] else {
                return Err("comm buffer is not a pointer".into());
            };
            let Val::Scalar(len) = r[2] else {
                return Err("comm size is not a scalar".into());
            };
            let comm = env.comm();
            let n = (len as usize).min(16);
            let start = usize::try_from(off).map_err(|_| "negative offset")?;
            let buf = regions
                .get_mut(region)
                .and_then(|m| m.get_mut(start..start + n))
                .ok_or("comm buffer out of bounds")?;
            buf.copy_from_slice(&comm[..n]);
            Ok(Val::Scalar(0))
        }
    }
}
