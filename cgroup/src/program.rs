//! The fence program, built purely from its parameters.
//!
//! In pseudo-C, for `BPF_PROG_TYPE_CGROUP_DEVICE` (context
//! `struct bpf_cgroup_dev_ctx`, `include/uapi/linux/bpf.h`):
//!
//! ```c
//! int fence(struct bpf_cgroup_dev_ctx *ctx) {
//!     if ((ctx->access_type & 0xffff) != BPF_DEVCG_DEV_CHAR) return 1;
//!     u32 access = ctx->access_type >> 16;
//!     u32 *p = majors[ctx->major];
//!     if (!p || !*p) return 1;                       // not an NVIDIA major
//!     struct grant_key key = { 0, ctx->major, ctx->minor };
//!     u32 mask = levels[0];                          // levels holding any entry
//!     for (level = 1; level <= MAX_LEVEL; level++) { // unrolled
//!         if (!(mask & 1 << level)) continue;        // one bit test, no helper
//!         u64 id = bpf_get_current_ancestor_cgroup_id(level);
//!         if (!id) goto deny;                        // walked past the task's cgroup
//!         u32 *flags = cgroups[id];
//!         if (!flags) continue;
//!         if (*flags & EXEMPT) {                     // covers its class's uids only
//!             u32 uid = bpf_get_current_uid_gid();
//!             u32 class = *flags >> CLASS_SHIFT & CLASS_MASK;
//!             if (class == 0 && (uid == 0)) return 1;   // class 0: root only
//!             if (class == 1 && (uid == UID_1_0 || uid == UID_1_1 ...)) return 1;
//!             ...                                    // one test per class, immediates
//!         }                                          // anyone else: as if not exempt

//!         if (!(*flags & GRANTED)) continue;
//!         key.cgroup_id = id;
//!         struct grant_value *g = grants[key];
//!         if (g && !(access & ~g->access)) return 1;
//!         key.minor = ANY_MINOR;                     // major:* (IMEX channel mknod)
//!         g = grants[key];
//!         key.minor = ctx->minor;
//!         if (g && !(access & ~g->access)) return 1;
//!     }
//! deny:                                          // recorded, in both modes
//!     struct denial_key k = { cgroup_id(), uid, major, minor, access };
//!     struct denial_value *v = denials[k];           // LRU hash
//!     if (v) { v->count++ (atomic); v->last_ns, last_pid, comm = now, tgid, comm; }
//!     else denials[k] = { 1, now, tgid, comm };
//!     return AUDIT ? 1 : 0;
//! }
//! ```
//!
//! Unprotected devices (`/dev/null`, disks) leave after one context load,
//! one compare, and one array lookup that the verifier inlines.

use std::mem::offset_of;

use gpufence_model::device::ANY_MINOR;
use gpufence_model::policy::ExemptIdentities;

use crate::asm::{AluOp, Asm, AsmError, Helper, JmpOp, Program, Reg, Size};
use crate::maps::{
    CgroupValue, DenialKey, DenialValue, GrantKey, GrantValue, CGROUP_CLASS_MASK,
    CGROUP_CLASS_SHIFT, CGROUP_EXEMPT, CGROUP_GRANTED,
};

/// How many cgroup levels below the root the program walks. Slurm's job
/// cgroup sits at level 3 (`system.slice/slurmstepd.scope/job_<id>`); tasks
/// at level 6. Levels are the kernel's (`cgroup->level`, from the root of
/// the whole hierarchy), which in a cgroup namespace are more than a path's
/// depth ([`crate::hierarchy::Cgroup2::kernel_level`]). Grants on cgroups
/// deeper than this are refused at grant time.
pub const MAX_LEVEL: usize = 16;

/// `struct bpf_cgroup_dev_ctx` (`include/uapi/linux/bpf.h`).
#[repr(C)]
pub struct BpfCgroupDevCtx {
    /// Device type (low 16 bits) | access (high 16 bits).
    pub access_type: u32,
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

pub use crate::uapi::DEVCG_DEV_CHAR;

const CTX_ACCESS_TYPE: i16 = offset_of!(BpfCgroupDevCtx, access_type) as i16;
const CTX_MAJOR: i16 = offset_of!(BpfCgroupDevCtx, major) as i16;
const CTX_MINOR: i16 = offset_of!(BpfCgroupDevCtx, minor) as i16;

// Stack slots (offsets from r10, the frame pointer).
const STACK_CGROUP_KEY: i16 = -8; // u64, key of `cgroups`
const STACK_GRANT_KEY: i16 = -24; // struct grant_key, 16 bytes, key of `grants`
const STACK_MAJOR_KEY: i16 = -28; // u32, key of `majors`
const STACK_LEVELS_KEY: i16 = -32; // u32 0, key of `levels`
const STACK_DENIAL_KEY: i16 = -56; // struct denial_key, 24 bytes
const STACK_DENIAL_VALUE: i16 = -96; // struct denial_value, 40 bytes
const STACK_FLAGS: i16 = -100; // u32, the flags of the cgroup being looked at

/// What the program needs: the fds of its maps, the walk depth, the mode
/// and whom exemptions cover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceProgramSpec {
    /// fd of the `majors` array.
    pub majors_fd: i32,
    /// fd of the `cgroups` hash.
    pub cgroups_fd: i32,
    /// fd of the `grants` hash.
    pub grants_fd: i32,
    /// fd of the `denials` LRU hash.
    pub denials_fd: i32,
    /// fd of the `levels` array (populated-levels mask).
    pub levels_fd: i32,
    /// Levels walked, 1..=`max_level` ([`MAX_LEVEL`] in production).
    pub max_level: usize,
    /// Audit mode: record what would be denied, and allow it.
    pub audit: bool,
    /// Whom an exempt cgroup of each class covers (compiled into the
    /// program as compare immediates: at most
    /// [`ExemptIdentities::MAX_CLASSES`] classes of at most
    /// [`ExemptIdentities::MAX_UIDS`] uids, each at most
    /// [`ExemptIdentities::MAX_UID`]: [`ExemptIdentities::fits`]).
    pub identities: ExemptIdentities,
}

/// Builds the fence program, in the blocks runc's device filter has
/// (`libcontainer/cgroups/devices/devicefilter.go`: a prologue, one block
/// per rule, an epilogue): `init` (the context loads and the
/// protected-major check), `levels_mask`, one `level_block` per cgroup
/// level walked, then `finalize` (the denial record and the verdict).
/// Each emits into the same [`Asm`], in that order.
///
/// # Errors
/// [`AsmError::Identities`] when `spec.identities` is out of range (the
/// config refuses such values); otherwise only if the builder itself is
/// wrong.
pub fn build(spec: &FenceProgramSpec) -> Result<Program, AsmError> {
    let ids = &spec.identities;
    if !ids.fits() {
        return Err(AsmError::Identities(format!("{ids:?}")));
    }
    let mut a = Asm::new();
    init(&mut a, spec);
    levels_mask(&mut a, spec);
    for level in 1..=spec.max_level {
        level_block(&mut a, spec, level);
    }
    finalize(&mut a, spec);
    a.assemble()
}

/// The prologue: a character device, else allow; `r7` the access, `r8`
/// the major, `r9` the minor (`struct bpf_cgroup_dev_ctx`); a major the
/// `majors` map does not protect is allowed; the grant key's major and
/// minor.
fn init(a: &mut Asm, spec: &FenceProgramSpec) {
    use Reg::*;
    a.comment("u32 t = ctx->access_type; if ((t & 0xffff) != BPF_DEVCG_DEV_CHAR) return 1;")
        .load(Size::W, R2, R1, CTX_ACCESS_TYPE)
        .mov64_reg(R3, R2)
        .alu64_imm(AluOp::And, R3, 0xffff)
        .jmp_imm(JmpOp::Ne, R3, DEVCG_DEV_CHAR, "allow")
        .comment("r7 = access = t >> 16; r8 = major; r9 = minor")
        .mov64_reg(R7, R2)
        .alu64_imm(AluOp::Rsh, R7, 16)
        .load(Size::W, R8, R1, CTX_MAJOR)
        .load(Size::W, R9, R1, CTX_MINOR)
        .comment("u32 *p = majors[major]; if (!p || !*p) return 1;")
        .store(Size::W, R10, STACK_MAJOR_KEY, R8)
        .ld_map_fd(R1, spec.majors_fd, "majors")
        .mov64_reg(R2, R10)
        .alu64_imm(AluOp::Add, R2, STACK_MAJOR_KEY as i32)
        .call(Helper::MapLookupElem)
        .jmp_imm(JmpOp::Eq, R0, 0, "allow")
        .load(Size::W, R1, R0, 0)
        .jmp_imm(JmpOp::Eq, R1, 0, "allow")
        .comment("key.major = major; key.minor = minor;")
        .store(Size::W, R10, STACK_GRANT_KEY + GrantKey::OFF_MAJOR, R8)
        .store(Size::W, R10, STACK_GRANT_KEY + GrantKey::OFF_MINOR, R9);
}

/// `r6`, the populated-levels mask (`levels[0]`): levels where no cgroup
/// has an entry are skipped without a helper call; no mask, deny.
fn levels_mask(a: &mut Asm, spec: &FenceProgramSpec) {
    use Reg::*;
    a.comment(
        "r6 = mask = levels[0]; if (!p) goto deny;  /* levels where some cgroup has an entry */",
    )
    .store_imm(Size::W, R10, STACK_LEVELS_KEY, 0)
    .ld_map_fd(R1, spec.levels_fd, "levels")
    .mov64_reg(R2, R10)
    .alu64_imm(AluOp::Add, R2, STACK_LEVELS_KEY as i32)
    .call(Helper::MapLookupElem)
    .jmp_imm(JmpOp::Eq, R0, 0, "deny")
    .load(Size::W, R6, R0, 0);
}

/// One rule: cgroup level `level` of the task's ancestry. Skipped when
/// the mask has no entry there; the ancestor's `cgroups` flags; an
/// exempt cgroup allows a task whose uid its identity class (the flags'
/// bits at [`CGROUP_CLASS_SHIFT`]) holds, and goes on to its grants
/// otherwise (a class index with no class allows no one); a granted cgroup allows
/// an access its `grants` entry for the device covers, or its entry for
/// every minor of the device's major (`major:*`, [`ANY_MINOR`]), looked
/// up only when the first does not allow.
fn level_block(a: &mut Asm, spec: &FenceProgramSpec, level: usize) {
    use Reg::*;
    let ids = &spec.identities;
    let next = format!("level_{}", level + 1);
    let body = format!("walk_{level}");
    let any = format!("any_minor_{level}");
    a.label(&format!("level_{level}"))
        .comment(&format!("if (!(mask & 1 << {level})) continue;"))
        .jmp_imm(JmpOp::Set, R6, 1 << level, &body)
        .ja(&next)
        .label(&body)
        .comment(&format!(
            "id = ancestor_cgroup_id({level}); if (!id) goto deny; f = cgroups[id]; if (!f) continue;"
        ))
        .mov64_imm(R1, level as i32)
        .call(Helper::GetCurrentAncestorCgroupId)
        .jmp_imm(JmpOp::Eq, R0, 0, "deny")
        .store(Size::DW, R10, STACK_CGROUP_KEY, R0)
        .store(Size::DW, R10, STACK_GRANT_KEY + GrantKey::OFF_CGROUP_ID, R0)
        .ld_map_fd(R1, spec.cgroups_fd, "cgroups")
        .mov64_reg(R2, R10)
        .alu64_imm(AluOp::Add, R2, STACK_CGROUP_KEY as i32)
        .call(Helper::MapLookupElem)
        .jmp_imm(JmpOp::Eq, R0, 0, &next)
        .comment("if (*f & EXEMPT) goto exempt; if (!(*f & GRANTED)) continue;")
        .load(Size::W, R1, R0, CgroupValue::OFF_FLAGS)
        .jmp_imm(JmpOp::Set, R1, CGROUP_EXEMPT as i32, &format!("exempt_{level}"))
        .label(&format!("grant_{level}"))
        .alu64_imm(AluOp::And, R1, CGROUP_GRANTED as i32)
        .jmp_imm(JmpOp::Eq, R1, 0, &next)
        .comment("g = grants[{id, major, minor}]; if (g && !(access & ~g->access)) return 1;")
        .ld_map_fd(R1, spec.grants_fd, "grants")
        .mov64_reg(R2, R10)
        .alu64_imm(AluOp::Add, R2, STACK_GRANT_KEY as i32)
        .call(Helper::MapLookupElem)
        .jmp_imm(JmpOp::Eq, R0, 0, &any)
        .load(Size::W, R1, R0, GrantValue::OFF_ACCESS)
        .alu32_imm(AluOp::Xor, R1, -1)
        .alu64_reg(AluOp::And, R1, R7)
        .jmp_imm(JmpOp::Eq, R1, 0, "allow")
        .label(&any)
        .comment(
            "key.minor = ANY_MINOR; g = grants[key]; key.minor = minor; if (g && !(access & ~g->access)) return 1;",
        )
        .store_imm(Size::W, R10, STACK_GRANT_KEY + GrantKey::OFF_MINOR, ANY_MINOR as i32)
        .ld_map_fd(R1, spec.grants_fd, "grants")
        .mov64_reg(R2, R10)
        .alu64_imm(AluOp::Add, R2, STACK_GRANT_KEY as i32)
        .call(Helper::MapLookupElem)
        .store(Size::W, R10, STACK_GRANT_KEY + GrantKey::OFF_MINOR, R9)
        .jmp_imm(JmpOp::Eq, R0, 0, &next)
        .load(Size::W, R1, R0, GrantValue::OFF_ACCESS)
        .alu32_imm(AluOp::Xor, R1, -1)
        .alu64_reg(AluOp::And, R1, R7)
        .jmp_imm(JmpOp::Eq, R1, 0, "allow")
        .ja(&next)
        .label(&format!("exempt_{level}"))
        .comment("uid = get_current_uid_gid(); class = f >> CLASS_SHIFT & CLASS_MASK;")
        .store(Size::W, R10, STACK_FLAGS, R1)
        .call(Helper::GetCurrentUidGid)
        .alu32_imm(AluOp::And, R0, -1)
        .load(Size::W, R1, R10, STACK_FLAGS)
        .alu64_imm(AluOp::Rsh, R1, CGROUP_CLASS_SHIFT as i32)
        .alu64_imm(AluOp::And, R1, CGROUP_CLASS_MASK as i32);
    let done = format!("exempt_{level}_none");
    for (c, uids) in ids.classes.iter().enumerate() {
        let other = format!("exempt_{level}_class_{}", c + 1);
        a.comment(&format!(
            "if (class == {c} && uid in {uids:?}) return 1; else its grants, as for any cgroup"
        ))
        .jmp_imm(JmpOp::Ne, R1, c as i32, &other);
        for uid in uids {
            a.jmp_imm(JmpOp::Eq, R0, *uid as i32, "allow");
        }
        a.label(&other);
    }
    a.label(&done)
        .load(Size::W, R1, R10, STACK_FLAGS)
        .ja(&format!("grant_{level}"));
}

/// The epilogue: at `deny`, the denial recorded in the `denials` LRU map
/// (a new entry, or the count, time, pid and comm of an existing one),
/// then the verdict (0, or 1 in audit mode); at `allow`, 1.
fn finalize(a: &mut Asm, spec: &FenceProgramSpec) {
    use Reg::*;
    a.label(&format!("level_{}", spec.max_level + 1))
        .label("deny")
        .comment("k = { cgroup_id(), uid, major, minor, access };")
        .call(Helper::GetCurrentCgroupId)
        .store(
            Size::DW,
            R10,
            STACK_DENIAL_KEY + DenialKey::OFF_CGROUP_ID,
            R0,
        )
        .call(Helper::GetCurrentUidGid)
        .store(Size::W, R10, STACK_DENIAL_KEY + DenialKey::OFF_UID, R0)
        .store(Size::W, R10, STACK_DENIAL_KEY + DenialKey::OFF_MAJOR, R8)
        .store(Size::W, R10, STACK_DENIAL_KEY + DenialKey::OFF_MINOR, R9)
        .store(Size::W, R10, STACK_DENIAL_KEY + DenialKey::OFF_ACCESS, R7)
        .comment("v = denials[k]; if (!v) goto deny_new;")
        .ld_map_fd(R1, spec.denials_fd, "denials")
        .mov64_reg(R2, R10)
        .alu64_imm(AluOp::Add, R2, STACK_DENIAL_KEY as i32)
        .call(Helper::MapLookupElem)
        .jmp_imm(JmpOp::Eq, R0, 0, "deny_new")
        .comment("v->count++ (atomic); v->last_ns = ktime; v->last_pid = tgid; v->comm = comm;")
        .mov64_reg(R6, R0)
        .mov64_imm(R1, 1)
        .atomic_add64(R6, DenialValue::OFF_COUNT, R1)
        .call(Helper::KtimeGetNs)
        .store(Size::DW, R6, DenialValue::OFF_LAST_NS, R0)
        .call(Helper::GetCurrentPidTgid)
        .alu64_imm(AluOp::Rsh, R0, 32)
        .store(Size::W, R6, DenialValue::OFF_LAST_PID, R0)
        .mov64_reg(R1, R6)
        .alu64_imm(AluOp::Add, R1, DenialValue::OFF_COMM as i32)
        .mov64_imm(R2, DenialValue::COMM_LEN as i32)
        .call(Helper::GetCurrentComm)
        .ja("verdict")
        .label("deny_new")
        .comment("denials[k] = { 1, ktime, tgid, 0, comm };  (LRU: the oldest entry makes room)")
        .store_imm(
            Size::DW,
            R10,
            STACK_DENIAL_VALUE + DenialValue::OFF_COUNT,
            1,
        )
        .call(Helper::KtimeGetNs)
        .store(
            Size::DW,
            R10,
            STACK_DENIAL_VALUE + DenialValue::OFF_LAST_NS,
            R0,
        )
        .call(Helper::GetCurrentPidTgid)
        .alu64_imm(AluOp::Rsh, R0, 32)
        .store(
            Size::W,
            R10,
            STACK_DENIAL_VALUE + DenialValue::OFF_LAST_PID,
            R0,
        )
        .store_imm(Size::W, R10, STACK_DENIAL_VALUE + DenialValue::OFF_PAD, 0)
        .mov64_reg(R1, R10)
        .alu64_imm(
            AluOp::Add,
            R1,
            (STACK_DENIAL_VALUE + DenialValue::OFF_COMM) as i32,
        )
        .mov64_imm(R2, DenialValue::COMM_LEN as i32)
        .call(Helper::GetCurrentComm)
        .ld_map_fd(R1, spec.denials_fd, "denials")
        .mov64_reg(R2, R10)
        .alu64_imm(AluOp::Add, R2, STACK_DENIAL_KEY as i32)
        .mov64_reg(R3, R10)
        .alu64_imm(AluOp::Add, R3, STACK_DENIAL_VALUE as i32)
        .mov64_imm(R4, 0)
        .call(Helper::MapUpdateElem)
        .label("verdict");
    if spec.audit {
        a.comment("return 1;  /* audit mode: recorded, allowed */")
            .mov64_imm(R0, 1);
    } else {
        a.comment("return 0;  /* EPERM */").mov64_imm(R0, 0);
    }
    a.exit()
        .label("allow")
        .comment("return 1;")
        .mov64_imm(R0, 1)
        .exit();
}

/// The feature probe: a device program that calls every helper the fence
/// calls that older kernels lack for device programs
/// (`bpf_get_current_ancestor_cgroup_id`, `get_current_cgroup_id`,
/// `get_current_pid_tgid`, `get_current_comm`: all in
/// `cgroup_current_func_proto` since 6.1) and allows. The kernel refuses to
/// load it when one is missing.
pub fn probe() -> Result<Program, AsmError> {
    use Reg::*;
    let mut a = Asm::new();
    a.comment("ancestor_cgroup_id(1); cgroup_id(); pid_tgid(); comm(buf, 16); return 1;")
        .mov64_imm(R1, 1)
        .call(Helper::GetCurrentAncestorCgroupId)
        .call(Helper::GetCurrentCgroupId)
        .call(Helper::GetCurrentPidTgid)
        .call(Helper::GetCurrentUidGid)
        .call(Helper::KtimeGetNs)
        .mov64_reg(R1, R10)
        .alu64_imm(AluOp::Add, R1, -16)
        .mov64_imm(R2, 16)
        .call(Helper::GetCurrentComm)
        .mov64_imm(R0, 1)
        .exit();
    a.assemble()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{self, Env};
    use crate::maps::{DenialKey, DenialValue, GrantValue, MAJOR_PROTECTED};
    use gpufence_model::device::{Access, DevNum};
    use gpufence_model::policy::{DevType, Policy, Request};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const MAJORS: i32 = 11;
    const CGROUPS: i32 = 12;
    const GRANTS: i32 = 13;
    const DENIALS: i32 = 14;
    const LEVELS: i32 = 15;

    /// A map update the program made: `(map fd, key, value)`.
    type Update = (i32, Vec<u8>, Vec<u8>);

    fn spec(max_level: usize) -> FenceProgramSpec {
        FenceProgramSpec {
            majors_fd: MAJORS,
            cgroups_fd: CGROUPS,
            grants_fd: GRANTS,
            denials_fd: DENIALS,
            levels_fd: LEVELS,
            max_level,
            audit: false,
            identities: ExemptIdentities {
                classes: vec![[0].into(), [0, 1500].into()],
            },
        }
    }

    /// The maps as the fence would fill them from a [`Policy`].
    struct PolicyEnv<'a> {
        policy: &'a Policy,
        ancestry: &'a [u64],
        grant_jobs: BTreeMap<(u64, DevNum), u32>,
        /// Bits set in the levels mask beyond the levels that hold an
        /// entry of this ancestry (the real mask covers every cgroup's).
        extra_mask: u32,
        /// The task's uid.
        uid: u32,
        updates: std::cell::RefCell<Vec<Update>>,
    }

    impl Env for PolicyEnv<'_> {
        fn key_size(&self, fd: i32) -> Option<usize> {
            match fd {
                MAJORS => Some(4),
                CGROUPS => Some(8),
                GRANTS => Some(GrantKey::SIZE),
                DENIALS => Some(DenialKey::SIZE),
                LEVELS => Some(4),
                _ => None,
            }
        }
        fn value_size(&self, fd: i32) -> Option<usize> {
            (fd == DENIALS).then_some(DenialValue::SIZE)
        }
        fn map_update(&self, fd: i32, key: &[u8], value: &[u8]) -> i64 {
            self.updates
                .borrow_mut()
                .push((fd, key.to_vec(), value.to_vec()));
            0
        }
        fn cgroup_id(&self) -> u64 {
            *self.ancestry.last().unwrap_or(&0)
        }
        fn uid_gid(&self) -> u64 {
            (2000u64 << 32) | u64::from(self.uid)
        }
        fn pid_tgid(&self) -> u64 {
            (4242u64 << 32) | 4243
        }
        fn comm(&self) -> [u8; 16] {
            *b"xmrig\0\0\0\0\0\0\0\0\0\0\0"
        }
        fn ktime_ns(&self) -> u64 {
            777
        }
        fn map_lookup(&self, fd: i32, key: &[u8]) -> Option<Vec<u8>> {
            match fd {
                MAJORS => {
                    let m = u32::from_ne_bytes(key.try_into().ok()?);
                    (m < crate::maps::MAJORS_ENTRIES).then(|| {
                        let v = if self.policy.protected.contains(&m) {
                            MAJOR_PROTECTED
                        } else {
                            0
                        };
                        v.to_ne_bytes().to_vec()
                    })
                }
                CGROUPS => {
                    let id = u64::from_ne_bytes(key.try_into().ok()?);
                    let mut f = 0;
                    if let Some(class) = self.policy.exempt.get(&id) {
                        f |= crate::maps::with_class(CGROUP_EXEMPT, *class);
                    }
                    if self.policy.grants.keys().any(|(c, _)| *c == id) {
                        f |= CGROUP_GRANTED;
                    }
                    let level = self.ancestry.iter().position(|a| *a == id).unwrap_or(0) as u32;
                    (f != 0).then(|| [f.to_ne_bytes(), level.to_ne_bytes()].concat())
                }
                LEVELS => (u32::from_ne_bytes(key.try_into().ok()?) == 0).then(|| {
                    let mut mask = self.extra_mask;
                    for (level, id) in self.ancestry.iter().enumerate().skip(1).take(31) {
                        if self.policy.exempt.contains_key(id)
                            || self.policy.grants.keys().any(|(c, _)| c == id)
                        {
                            mask |= 1 << level;
                        }
                    }
                    mask.to_ne_bytes().to_vec()
                }),
                GRANTS => {
                    let k = GrantKey::from_bytes(key)?;
                    let access = *self.policy.grants.get(&(k.cgroup_id, k.dev()))?;
                    let job_id = self
                        .grant_jobs
                        .get(&(k.cgroup_id, k.dev()))
                        .copied()
                        .unwrap_or(1);
                    Some(GrantValue::new(access, job_id).to_bytes().to_vec())
                }
                _ => None,
            }
        }
        fn ancestor_cgroup_id(&self, level: u64) -> u64 {
            self.ancestry.get(level as usize).copied().unwrap_or(0)
        }
    }

    fn run(policy: &Policy, ancestry: &[u64], req: &Request, max_level: usize) -> bool {
        run_mode(policy, ancestry, req, max_level, false).0
    }

    /// The uid the tests' tasks run as unless they say.
    const UID: u32 = 1001;

    /// Runs the program; returns the verdict and the denial records written.
    fn run_mode(
        policy: &Policy,
        ancestry: &[u64],
        req: &Request,
        max_level: usize,
        audit: bool,
    ) -> (bool, Vec<Update>) {
        run_masked(policy, ancestry, UID, req, max_level, audit, 0)
    }

    /// [`run_mode`] for a task of `uid`, with `extra_mask` bits set in the
    /// levels mask. The program's exempt identities are the policy's.
    fn run_masked(
        policy: &Policy,
        ancestry: &[u64],
        uid: u32,
        req: &Request,
        max_level: usize,
        audit: bool,
        extra_mask: u32,
    ) -> (bool, Vec<Update>) {
        let prog = build(&FenceProgramSpec {
            audit,
            identities: policy.identities.clone(),
            ..spec(max_level)
        })
        .unwrap();
        let env = PolicyEnv {
            policy,
            ancestry,
            grant_jobs: BTreeMap::new(),
            extra_mask,
            uid,
            updates: Default::default(),
        };
        let ctx = [
            req.dev_type.raw() | (req.access.bits() << 16),
            req.dev.major,
            req.dev.minor,
        ];
        let verdict = match interp::run(&prog.insns, ctx, &env).expect("program runs") {
            0 => false,
            1 => true,
            other => panic!("program returned {other}"),
        };
        (verdict, env.updates.into_inner())
    }

    #[test]
    fn golden_listing_depth_2() {
        let got = build(&spec(2)).unwrap().listing;
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/fence-depth2.listing");
        if std::env::var_os("GPUFENCE_UPDATE_GOLDEN").is_some() {
            std::fs::write(&path, &got).unwrap();
        }
        let want = std::fs::read_to_string(&path)
            .expect("golden listing (GPUFENCE_UPDATE_GOLDEN=1 writes it)");
        assert_eq!(
            got, want,
            "listing changed; review and rerun with GPUFENCE_UPDATE_GOLDEN=1"
        );
    }

    #[test]
    fn production_program_size() {
        let p = build(&spec(MAX_LEVEL)).unwrap();
        // 19 instructions of prologue, 8 to load the levels mask, 40 per
        // level (2 of them the mask test, 12 the major-wide lookup) and,
        // for an exempt cgroup, 8 + one per class + one per uid of each
        // class (here {0} and {0, 1500}), 49 of deny (record) and allow
        assert_eq!(
            p.insns.len(),
            19 + 8 + (40 + 8 + (1 + 1) + (1 + 2)) * MAX_LEVEL + 49
        );
    }

    #[test]
    fn table_against_policy() {
        let policy = Policy {
            protected: [195, 509].into(),
            exempt: [(50, 1)].into(),
            identities: spec(MAX_LEVEL).identities,
            grants: [
                ((10, DevNum::new(195, 0)), Access::RW),
                ((10, DevNum::new(195, 255)), Access::RW),
                ((11, DevNum::new(195, 1)), Access::READ),
            ]
            .into(),
        };
        let char_req = |major, minor, access| Request {
            dev_type: DevType::Char,
            dev: DevNum::new(major, minor),
            access,
        };
        let cases: &[(&[u64], Request, bool)] = &[
            (&[1, 7, 10, 12, 13], char_req(195, 0, Access::RW), true),
            (&[1, 7, 10], char_req(195, 255, Access::READ), true),
            (&[1, 7, 10], char_req(195, 1, Access::READ), false),
            (&[1, 7, 10], char_req(195, 0, Access::all()), false),
            (&[1, 7, 8], char_req(195, 0, Access::READ), false),
            (&[1, 7, 8], char_req(1, 3, Access::RW), true),
            (&[1, 50, 51, 52], char_req(509, 1, Access::all()), false),
            (&[1, 11], char_req(195, 1, Access::WRITE), false),
            (&[1, 11], char_req(195, 1, Access::READ), true),
            (&[1], char_req(195, 0, Access::READ), false),
        ];
        for (anc, req, want) in cases {
            assert_eq!(run(&policy, anc, req, MAX_LEVEL), *want, "{anc:?} {req:?}");
            assert_eq!(
                policy.allows(anc, UID, req, MAX_LEVEL),
                *want,
                "model: {anc:?} {req:?}"
            );
        }
        // A major-wide grant (IMEX channels: mknod of any minor in the job
        // cgroup) with an exact grant of one channel beside it.
        let imex = Policy {
            protected: [195, 120].into(),
            grants: [
                ((10, DevNum::any_minor(120)), Access::MKNOD),
                ((10, DevNum::new(120, 3)), Access::RW),
                ((11, DevNum::new(120, 4)), Access::READ),
            ]
            .into(),
            ..policy.clone()
        };
        for (anc, req, want) in [
            (
                &[1u64, 7, 10, 12][..],
                char_req(120, 9, Access::MKNOD),
                true,
            ),
            (&[1, 7, 10, 12], char_req(120, 3, Access::MKNOD), true),
            (&[1, 7, 10, 12], char_req(120, 3, Access::RW), true),
            (&[1, 7, 10, 12], char_req(120, 9, Access::READ), false),
            (&[1, 7, 10, 12], char_req(120, 3, Access::all()), false),
            (&[1, 7, 11], char_req(120, 4, Access::MKNOD), false),
            (&[1, 7, 11], char_req(120, 4, Access::READ), true),
            (&[1, 7, 8], char_req(120, 9, Access::MKNOD), false),
            (&[1, 7, 10], char_req(195, 9, Access::MKNOD), false),
            (&[1, 7, 10], char_req(120, ANY_MINOR, Access::MKNOD), true),
        ] {
            assert_eq!(run(&imex, anc, &req, MAX_LEVEL), want, "{anc:?} {req:?}");
            assert_eq!(
                imex.allows(anc, UID, &req, MAX_LEVEL),
                want,
                "model: {anc:?} {req:?}"
            );
        }
        // A cgroup both exempt and granted: a user's task there still has
        // the grant.
        let both = Policy {
            exempt: [(10, 0)].into(),
            ..policy.clone()
        };
        let req = char_req(195, 0, Access::RW);
        let (got, _) = run_masked(&both, &[1, 7, 10], 1001, &req, MAX_LEVEL, false, 0);
        assert!(got, "the grant of an exempt cgroup, for a user's task");
        assert!(both.allows(&[1, 7, 10], 1001, &req, MAX_LEVEL));
        let (got, _) = run_masked(
            &both,
            &[1, 7, 10],
            1001,
            &char_req(195, 1, Access::READ),
            MAX_LEVEL,
            false,
            0,
        );
        assert!(!got, "nothing more");
        // The exempt cgroup covers its class's uids (root and the service
        // uid); anyone else there (uid 1001 above, a uid-600 user, a
        // system account) is fenced as elsewhere. A root-only cgroup
        // (class 0) does not cover the service uid, and a class index
        // with no class covers no one.
        let mut classes = policy.clone();
        classes.exempt.insert(60, 0);
        classes.exempt.insert(70, 5);
        for (uid, service, root_only, none) in [
            (0, true, true, false),
            (600, false, false, false),
            (999, false, false, false),
            (1000, false, false, false),
            (1500, true, false, false),
        ] {
            let req = char_req(509, 1, Access::all());
            for (anc, want) in [
                ([1, 50, 51, 52], service),
                ([1, 60, 61, 62], root_only),
                ([1, 70, 71, 72], none),
            ] {
                let (got, _) = run_masked(&classes, &anc, uid, &req, MAX_LEVEL, false, 0);
                assert_eq!(got, want, "uid {uid} in {anc:?}");
                assert_eq!(classes.allows(&anc, uid, &req, MAX_LEVEL), want);
            }
        }
        let block = Request {
            dev_type: DevType::Block,
            ..char_req(195, 0, Access::RW)
        };
        assert!(run(&policy, &[1, 8], &block, MAX_LEVEL));
    }

    #[test]
    fn a_denial_is_recorded_with_who_and_what() {
        let policy = Policy {
            protected: [195].into(),
            ..Default::default()
        };
        let req = Request {
            dev_type: DevType::Char,
            dev: DevNum::new(195, 3),
            access: Access::RW,
        };
        let (allowed, updates) = run_mode(&policy, &[1, 7, 9], &req, MAX_LEVEL, false);
        assert!(!allowed);
        assert_eq!(updates.len(), 1, "one new record");
        let (fd, key, value) = &updates[0];
        assert_eq!(*fd, DENIALS);
        let k = DenialKey::from_bytes(key).unwrap();
        assert_eq!(
            (k.cgroup_id, k.uid, k.dev(), k.access()),
            (9, 1001, DevNum::new(195, 3), Access::RW)
        );
        // A denied mknod is a record of its own, saying so.
        let (_, updates) = run_mode(
            &policy,
            &[1, 7, 9],
            &Request {
                access: Access::MKNOD,
                ..req
            },
            MAX_LEVEL,
            false,
        );
        let k = DenialKey::from_bytes(&updates[0].1).unwrap();
        assert_eq!(k.access(), Access::MKNOD);
        let v = DenialValue::from_bytes(value).unwrap();
        assert_eq!(
            (v.count, v.last_ns, v.last_pid, v.comm_str().as_str()),
            (1, 777, 4242, "xmrig")
        );
        // Allowed and unprotected opens write nothing.
        let (ok, updates) = run_mode(
            &policy,
            &[1, 7, 9],
            &Request {
                dev: DevNum::new(1, 3),
                ..req
            },
            MAX_LEVEL,
            false,
        );
        assert!(ok && updates.is_empty());
        // Audit mode: the same record, and the open is allowed.
        let (allowed, updates) = run_mode(&policy, &[1, 7, 9], &req, MAX_LEVEL, true);
        assert!(allowed);
        assert_eq!(updates.len(), 1);
    }

    fn arb_policy() -> impl Strategy<Value = Policy> {
        let ids = 1u64..12;
        // Some grants are major-wide (`major:*`, IMEX channel mknod).
        let dev = (
            prop::sample::select(vec![195u32, 509, 10]),
            prop_oneof![3 => 0u32..4, 1 => Just(ANY_MINOR)],
        )
            .prop_map(|(a, b)| DevNum::new(a, b));
        (
            prop::collection::btree_set(prop::sample::select(vec![195u32, 509, 10, 1]), 0..4),
            prop::collection::btree_set(ids.clone(), 0..3),
            prop::collection::btree_map(
                (ids, dev),
                (0u32..8).prop_map(Access::from_bits_truncate),
                0..12,
            ),
            // Up to 4 classes of up to 3 uids; a class index may name no
            // class (covers no one).
            prop::collection::vec(
                prop::collection::btree_set(
                    prop::sample::select(vec![0u32, 600, 999, 1000, 1001, 1500]),
                    0..3,
                ),
                0..4,
            ),
        )
            .prop_flat_map(|(protected, exempt, grants, classes)| {
                let n = exempt.len();
                (
                    Just((protected, exempt, grants, classes)),
                    prop::collection::vec(0u32..6, n),
                )
            })
            .prop_map(|((protected, exempt, grants, classes), class_ix)| Policy {
                protected,
                exempt: exempt.into_iter().zip(class_ix).collect(),
                identities: ExemptIdentities { classes },
                grants,
            })
    }

    proptest! {
        #[test]
        fn program_matches_policy(
            policy in arb_policy(),
            ancestry in prop::collection::vec(1u64..12, 1..8),
            major in prop::sample::select(vec![195u32, 509, 10, 1]),
            minor in 0u32..4,
            access in (1u32..8).prop_map(Access::from_bits_truncate),
            block in any::<bool>(),
            max_level in 1usize..6,
            extra_mask in any::<u32>(),
            uid in prop::sample::select(vec![0u32, 600, 999, 1000, 1001, 1500, 60000, 0x8000_0000, u32::MAX]),
        ) {
            let req = Request {
                dev_type: if block { DevType::Block } else { DevType::Char },
                dev: DevNum::new(major, minor),
                access,
            };
            let want = policy.allows(&ancestry, uid, &req, max_level);
            let (got, updates) = run_masked(&policy, &ancestry, uid, &req, max_level, false, 0);
            prop_assert_eq!(got, want);
            // Levels marked populated without an entry change nothing.
            let (masked, _) =
                run_masked(&policy, &ancestry, uid, &req, max_level, false, extra_mask);
            prop_assert_eq!(masked, want);
            // A denial is recorded exactly when it is denied.
            prop_assert_eq!(updates.len(), usize::from(!want));
            // Audit mode allows everything, records the same.
            let (audit_got, audit_updates) =
                run_masked(&policy, &ancestry, uid, &req, max_level, true, 0);
            prop_assert!(audit_got);
            prop_assert_eq!(audit_updates.len(), usize::from(!want));
        }
    }

    /// The fence program for several depths, modes and identity sets
    /// emits exactly the instructions it emitted when these fingerprints
    /// were recorded (the listing test covers depth 2, enforcing).
    #[test]
    fn programs_keep_their_bytes() {
        let mut got = Vec::new();
        for (max_level, audit, uids) in [
            (1, false, vec![]),
            (2, true, vec![1500]),
            (MAX_LEVEL, false, vec![1500, 2000, 3000]),
            (MAX_LEVEL, true, vec![]),
        ] {
            let mut s = spec(max_level);
            s.audit = audit;
            s.identities.classes = vec![[0].into(), uids.into_iter().collect()];
            got.push(crate::iter::tests::insn_hash(&build(&s).unwrap()));
        }
        assert_eq!(got, RECORDED, "{got:?}");
    }
    const RECORDED: [(usize, u64); 4] = [
        (127, 4881032061506738660),
        (180, 17007688149363632874),
        (940, 12528117148996040174),
        (892, 10540568885386528701),
    ];
}
