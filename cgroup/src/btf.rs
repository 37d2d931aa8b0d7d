//! Just enough of the BPF Type Format to find the kernel's own type ids and
//! struct member offsets: what a BPF iterator program needs to be loaded
//! (`attach_btf_id`) and to read kernel structs through typed pointers.
//!
//! The format is `include/uapi/linux/btf.h`: a `struct btf_header`, then a
//! type section of `struct btf_type` records (each followed by kind-specific
//! data whose length depends on the kind and `vlen`) and a string section.
//! Type id 0 is `void`; the first record is id 1.
//!
//! Why not a crate: `btf-rs` 2.0 parses `/sys/kernel/btf/vmlinux` (5.5 MB
//! here) in 370 ms with its caching backend and 49 ms with its mmap backend,
//! against a 250 ms budget for the whole epilog scan; this module makes one
//! pass that indexes type offsets and compares names only where asked
//! (a few ms). Every read is bounds-checked: malformed input is a
//! [`BtfError`], never a panic.

use std::path::Path;

/// `BTF_MAGIC` (`include/uapi/linux/btf.h`), in the byte order of the
/// machine that wrote the data.
pub const BTF_MAGIC: u16 = 0xeb9f;

/// Where the running kernel publishes its BTF (`CONFIG_DEBUG_INFO_BTF`,
/// `kernel/bpf/sysfs_btf.c`).
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Kinds (`BTF_KIND_*`, `include/uapi/linux/btf.h`).
pub(crate) mod kind {
    pub const INT: u32 = 1;
    pub const PTR: u32 = 2;
    pub const ARRAY: u32 = 3;
    pub const STRUCT: u32 = 4;
    pub const UNION: u32 = 5;
    pub const ENUM: u32 = 6;
    pub const FWD: u32 = 7;
    pub const TYPEDEF: u32 = 8;
    pub const VOLATILE: u32 = 9;
    pub const CONST: u32 = 10;
    pub const RESTRICT: u32 = 11;
    pub const FUNC: u32 = 12;
    pub const FUNC_PROTO: u32 = 13;
    pub const VAR: u32 = 14;
    pub const DATASEC: u32 = 15;
    pub const FLOAT: u32 = 16;
    pub const DECL_TAG: u32 = 17;
    pub const TYPE_TAG: u32 = 18;
    pub const ENUM64: u32 = 19;
}

/// Why BTF could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BtfError {
    /// The file could not be read.
    #[error("reading BTF: {0}")]
    Io(String),
    /// Shorter than its header or its sections say.
    #[error("BTF truncated: {0}")]
    Truncated(&'static str),
    /// Not BTF, or BTF of the other byte order.
    #[error("not BTF (magic {0:#06x})")]
    BadMagic(u16),
    /// A header or record that cannot be right.
    #[error("malformed BTF: {0}")]
    Malformed(String),
    /// The name is not there (with the kind sought).
    #[error("BTF has no {kind} named {name:?}")]
    NotFound {
        /// What was sought: "func", "struct", "member".
        kind: &'static str,
        /// Its name (`struct.member` for members).
        name: String,
    },
    /// The member exists but is not what a reader of it expects.
    #[error("BTF member {name}: {why}")]
    Unexpected {
        /// `struct.member`.
        name: String,
        /// What is wrong.
        why: String,
    },
}

/// A parsed BTF blob: the bytes and the offset of every type record.
#[derive(Debug)]
pub struct Btf {
    data: Vec<u8>,
    /// Absolute offset of the record of type id `i + 1`.
    types: Vec<u32>,
    str_start: usize,
    str_len: usize,
}

/// One struct member, resolved: where it is and how wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// Byte offset from the start of the outermost struct.
    pub offset: u32,
    /// Size in bytes of the member's type (through typedefs and qualifiers).
    pub size: u32,
    /// Whether the member is a pointer.
    pub is_ptr: bool,
}

fn u32_at(d: &[u8], off: usize) -> Option<u32> {
    let b = d.get(off..off.checked_add(4)?)?;
    Some(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

/// Length of the kind-specific data after a 12-byte `struct btf_type`
/// (the `btf_type_size` logic of `tools/lib/bpf/btf.c`).
fn extra_len(k: u32, vlen: usize) -> Option<usize> {
    Some(match k {
        kind::INT | kind::VAR | kind::DECL_TAG => 4,
        kind::PTR
        | kind::FWD
        | kind::TYPEDEF
        | kind::VOLATILE
        | kind::CONST
        | kind::RESTRICT
        | kind::FUNC
        | kind::FLOAT
        | kind::TYPE_TAG => 0,
        kind::ARRAY => 12,
        kind::STRUCT | kind::UNION | kind::DATASEC | kind::ENUM64 => 12 * vlen,
        kind::ENUM | kind::FUNC_PROTO => 8 * vlen,
        _ => return None,
    })
}

/// A type record's fixed part.
#[derive(Clone, Copy, Debug)]
struct TypeRec {
    off: usize,
    name_off: u32,
    kind: u32,
    vlen: usize,
    kind_flag: bool,
    size_or_type: u32,
}

impl Btf {
    /// Reads and parses the running kernel's BTF ([`VMLINUX_BTF`]).
    ///
    /// # Errors
    /// [`BtfError`] when the file is absent (`CONFIG_DEBUG_INFO_BTF=n`) or malformed.
    pub fn vmlinux() -> Result<Btf, BtfError> {
        Self::from_file(Path::new(VMLINUX_BTF))
    }

    /// Reads and parses a BTF file.
    ///
    /// # Errors
    /// [`BtfError`].
    pub fn from_file(path: &Path) -> Result<Btf, BtfError> {
        let data =
            std::fs::read(path).map_err(|e| BtfError::Io(format!("{}: {e}", path.display())))?;
        Self::from_bytes(data)
    }

    /// Parses a BTF blob (`struct btf_header` first).
    ///
    /// # Errors
    /// [`BtfError`] for anything malformed: truncation, a bad magic, sections
    /// outside the blob, an unknown kind.
    pub fn from_bytes(data: Vec<u8>) -> Result<Btf, BtfError> {
        // struct btf_header { __u16 magic; __u8 version; __u8 flags;
        //   __u32 hdr_len; __u32 type_off; __u32 type_len;
        //   __u32 str_off; __u32 str_len; }
        if data.len() < 24 {
            return Err(BtfError::Truncated("header"));
        }
        let magic = u16::from_ne_bytes([data[0], data[1]]);
        if magic != BTF_MAGIC {
            return Err(BtfError::BadMagic(magic));
        }
        if data[2] != 1 {
            return Err(BtfError::Malformed(format!("version {}", data[2])));
        }
        let field = |o| u32_at(&data, o).map(|v| v as usize);
        let (Some(hdr_len), Some(type_off), Some(type_len), Some(str_off), Some(str_len)) =
            (field(4), field(8), field(12), field(16), field(20))
        else {
            return Err(BtfError::Truncated("header"));
        };
        if hdr_len < 24 || hdr_len > data.len() {
            return Err(BtfError::Malformed(format!("hdr_len {hdr_len}")));
        }
        let within = |off: usize, len: usize| {
            hdr_len
                .checked_add(off)
                .and_then(|s| s.checked_add(len).map(|e| (s, e)))
                .filter(|(_, e)| *e <= data.len())
        };
        let (type_start, type_end) =
            within(type_off, type_len).ok_or(BtfError::Truncated("type section past the end"))?;
        let (str_start, _) =
            within(str_off, str_len).ok_or(BtfError::Truncated("string section past the end"))?;
        let mut types = Vec::with_capacity(type_len / 16);
        let mut off = type_start;
        while off < type_end {
            let (Some(info), Some(_)) = (u32_at(&data, off + 4), u32_at(&data, off + 8)) else {
                return Err(BtfError::Truncated("type record"));
            };
            let k = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let extra = extra_len(k, vlen)
                .ok_or_else(|| BtfError::Malformed(format!("unknown kind {k} at {off}")))?;
            let next = off + 12 + extra;
            if next > type_end {
                return Err(BtfError::Truncated("type record"));
            }
            types.push(u32::try_from(off).map_err(|_| BtfError::Malformed("too large".into()))?);
            off = next;
        }
        Ok(Btf {
            data,
            types,
            str_start,
            str_len,
        })
    }

    /// How many types (ids `1..=len`).
    pub fn len(&self) -> usize {
        self.types.len()
    }

    /// Whether there are no types.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }

    fn rec(&self, id: u32) -> Option<TypeRec> {
        let off = *self.types.get((id as usize).checked_sub(1)?)? as usize;
        let info = u32_at(&self.data, off + 4)?;
        Some(TypeRec {
            off,
            name_off: u32_at(&self.data, off)?,
            kind: (info >> 24) & 0x1f,
            vlen: (info & 0xffff) as usize,
            kind_flag: info >> 31 == 1,
            size_or_type: u32_at(&self.data, off + 8)?,
        })
    }

    /// The NUL-terminated name at `name_off` in the string section.
    fn name(&self, name_off: u32) -> Option<&[u8]> {
        let o = name_off as usize;
        if o >= self.str_len {
            return None;
        }
        let s = self
            .data
            .get(self.str_start + o..self.str_start + self.str_len)?;
        let end = s.iter().position(|b| *b == 0)?;
        Some(&s[..end])
    }

    fn ids_named(&self, k: u32, name: &str) -> impl Iterator<Item = u32> + '_ {
        let want = name.as_bytes().to_vec();
        (1..=self.types.len() as u32).filter(move |id| {
            self.rec(*id)
                .is_some_and(|r| r.kind == k && self.name(r.name_off) == Some(&want[..]))
        })
    }

    /// The id of the `BTF_KIND_FUNC` named `name` (e.g. `bpf_iter_task_file`,
    /// which `DEFINE_BPF_ITER_FUNC` in `include/linux/bpf.h` defines for
    /// each iterator target).
    ///
    /// # Errors
    /// [`BtfError::NotFound`].
    pub fn func_id(&self, name: &str) -> Result<u32, BtfError> {
        self.ids_named(kind::FUNC, name)
            .next()
            .ok_or_else(|| BtfError::NotFound {
                kind: "func",
                name: name.to_string(),
            })
    }

    /// The id of the `BTF_KIND_STRUCT` named `name` (e.g. `file`).
    ///
    /// # Errors
    /// [`BtfError::NotFound`].
    pub fn struct_id(&self, name: &str) -> Result<u32, BtfError> {
        self.ids_named(kind::STRUCT, name)
            .next()
            .ok_or_else(|| BtfError::NotFound {
                kind: "struct",
                name: name.to_string(),
            })
    }

    /// Follows typedefs and qualifiers to the type they name (at most 32
    /// hops: a loop in crafted input is an error).
    fn resolve(&self, mut id: u32) -> Option<TypeRec> {
        for _ in 0..32 {
            let r = self.rec(id)?;
            match r.kind {
                kind::TYPEDEF | kind::VOLATILE | kind::CONST | kind::RESTRICT | kind::TYPE_TAG => {
                    id = r.size_or_type;
                }
                _ => return Some(r),
            }
        }
        None
    }

    fn size_of(&self, r: &TypeRec) -> Option<u32> {
        match r.kind {
            kind::INT | kind::ENUM | kind::ENUM64 | kind::STRUCT | kind::UNION | kind::FLOAT => {
                Some(r.size_or_type)
            }
            kind::PTR => Some(8),
            kind::ARRAY => {
                // struct btf_array { __u32 type; __u32 index_type; __u32 nelems; }
                let elem = self.resolve(u32_at(&self.data, r.off + 12)?)?;
                let n = u32_at(&self.data, r.off + 20)?;
                self.size_of(&elem)?.checked_mul(n)
            }
            _ => None,
        }
    }

    /// Looks for `member` among the members of the struct or union `r`,
    /// descending into anonymous struct and union members (C11 anonymous
    /// members, as `struct inode` and `struct vm_area_struct` use).
    fn find_member(&self, r: &TypeRec, member: &[u8], base_bits: u64, depth: u32) -> Option<Found> {
        if depth > 8 {
            return None;
        }
        for i in 0..r.vlen {
            // struct btf_member { __u32 name_off; __u32 type; __u32 offset; }
            let m = r.off + 12 + 12 * i;
            let name_off = u32_at(&self.data, m)?;
            let ty = u32_at(&self.data, m + 4)?;
            let raw = u32_at(&self.data, m + 8)?;
            // With kind_flag, offset holds bitfield_size << 24 | bit_offset.
            let (bits, bitfield) = if r.kind_flag {
                (raw & 0xff_ffff, raw >> 24)
            } else {
                (raw, 0)
            };
            let at = base_bits + u64::from(bits);
            let name = self.name(name_off).unwrap_or_default();
            if name == member {
                return Some(Found {
                    bits: at,
                    bitfield,
                    ty,
                });
            }
            if name.is_empty() {
                if let Some(inner) = self.resolve(ty) {
                    if inner.kind == kind::STRUCT || inner.kind == kind::UNION {
                        if let Some(f) = self.find_member(&inner, member, at, depth + 1) {
                            return Some(f);
                        }
                    }
                }
            }
        }
        None
    }

    /// Where member `member` of `struct strukt` is, and how wide. When
    /// several structs share the name, the first that has the member wins.
    ///
    /// # Errors
    /// [`BtfError::NotFound`] for an unknown struct or member,
    /// [`BtfError::Unexpected`] for a bitfield or a member not on a byte
    /// boundary, or one whose size cannot be worked out.
    pub fn field(&self, strukt: &str, member: &str) -> Result<Field, BtfError> {
        let full = format!("{strukt}.{member}");
        let mut saw_struct = false;
        for id in self.ids_named(kind::STRUCT, strukt) {
            saw_struct = true;
            let Some(r) = self.rec(id) else { continue };
            let Some(f) = self.find_member(&r, member.as_bytes(), 0, 0) else {
                continue;
            };
            let unexpected = |why: String| BtfError::Unexpected {
                name: full.clone(),
                why,
            };
            if f.bitfield != 0 || f.bits % 8 != 0 {
                return Err(unexpected(format!(
                    "a bitfield or not byte-aligned (bit {})",
                    f.bits
                )));
            }
            let t = self
                .resolve(f.ty)
                .ok_or_else(|| unexpected(format!("type {} does not resolve", f.ty)))?;
            let size = self
                .size_of(&t)
                .ok_or_else(|| unexpected(format!("no size for kind {}", t.kind)))?;
            let offset = u32::try_from(f.bits / 8).map_err(|_| unexpected("offset".into()))?;
            return Ok(Field {
                offset,
                size,
                is_ptr: t.kind == kind::PTR,
            });
        }
        Err(BtfError::NotFound {
            kind: if saw_struct { "member" } else { "struct" },
            name: full,
        })
    }
}

struct Found {
    bits: u64,
    bitfield: u32,
    ty: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little BTF writer for the tests: types and strings.
    #[derive(Default)]
    struct Builder {
        types: Vec<u8>,
        strs: Vec<u8>,
    }

    impl Builder {
        fn new() -> Self {
            Builder {
                types: Vec::new(),
                strs: vec![0],
            }
        }
        fn s(&mut self, name: &str) -> u32 {
            if name.is_empty() {
                return 0;
            }
            let o = self.strs.len() as u32;
            self.strs.extend_from_slice(name.as_bytes());
            self.strs.push(0);
            o
        }
        fn rec(&mut self, name: &str, k: u32, vlen: u32, flag: bool, st: u32) {
            let n = self.s(name);
            for v in [n, (k << 24) | vlen | (u32::from(flag) << 31), st] {
                self.types.extend_from_slice(&v.to_ne_bytes());
            }
        }
        fn word(&mut self, v: u32) {
            self.types.extend_from_slice(&v.to_ne_bytes());
        }
        fn bytes(&self) -> Vec<u8> {
            let mut d = Vec::new();
            d.extend_from_slice(&BTF_MAGIC.to_ne_bytes());
            d.extend_from_slice(&[1, 0]);
            for v in [
                24u32,
                0,
                self.types.len() as u32,
                self.types.len() as u32,
                self.strs.len() as u32,
            ] {
                d.extend_from_slice(&v.to_ne_bytes());
            }
            d.extend_from_slice(&self.types);
            d.extend_from_slice(&self.strs);
            d
        }
    }

    /// ids: 1 int (4), 2 u16 typedef-free int, 3 ptr->1, 4 anon union
    /// {int a; u16 b}, 5 struct s { int x; <anon union 4> ; int *p; int bf:3 },
    /// 6 func "f", 7 typedef t -> 1.
    fn sample() -> Vec<u8> {
        let mut b = Builder::new();
        b.rec("int", kind::INT, 0, false, 4);
        b.word(32);
        b.rec("u16", kind::INT, 0, false, 2);
        b.word(16);
        b.rec("", kind::PTR, 0, false, 1);
        b.rec("", kind::UNION, 2, false, 4);
        let a = b.s("a");
        for v in [a, 1, 0] {
            b.word(v);
        }
        let bb = b.s("b");
        for v in [bb, 2, 0] {
            b.word(v);
        }
        b.rec("s", kind::STRUCT, 4, true, 24);
        let x = b.s("x");
        for v in [x, 7, 0] {
            b.word(v);
        }
        for v in [0, 4, 32] {
            b.word(v);
        }
        let p = b.s("p");
        for v in [p, 3, 64] {
            b.word(v);
        }
        let bf = b.s("bf");
        for v in [bf, 1, (3 << 24) | 128] {
            b.word(v);
        }
        b.rec("f", kind::FUNC, 0, false, 0);
        b.rec("t", kind::TYPEDEF, 0, false, 1);
        b.bytes()
    }

    #[test]
    fn finds_funcs_and_members_through_anonymous_unions() {
        let btf = Btf::from_bytes(sample()).unwrap();
        assert_eq!(btf.len(), 7);
        assert_eq!(btf.func_id("f").unwrap(), 6);
        assert_eq!(
            btf.field("s", "x").unwrap(),
            Field {
                offset: 0,
                size: 4,
                is_ptr: false
            }
        );
        assert_eq!(
            btf.field("s", "b").unwrap(),
            Field {
                offset: 4,
                size: 2,
                is_ptr: false
            }
        );
        assert_eq!(
            btf.field("s", "p").unwrap(),
            Field {
                offset: 8,
                size: 8,
                is_ptr: true
            }
        );
        assert!(matches!(
            btf.field("s", "bf"),
            Err(BtfError::Unexpected { .. })
        ));
        assert!(matches!(
            btf.field("s", "nope"),
            Err(BtfError::NotFound { kind: "member", .. })
        ));
        assert!(matches!(
            btf.field("nope", "x"),
            Err(BtfError::NotFound { kind: "struct", .. })
        ));
        assert!(matches!(
            btf.func_id("s"),
            Err(BtfError::NotFound { kind: "func", .. })
        ));
    }

    /// Every truncation and every single-byte corruption of a valid blob is
    /// an error or a parse; lookups on what parses never panic.
    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let good = sample();
        assert!(matches!(
            Btf::from_bytes(vec![]),
            Err(BtfError::Truncated(_))
        ));
        let mut swapped = good.clone();
        swapped.swap(0, 1);
        assert!(matches!(
            Btf::from_bytes(swapped),
            Err(BtfError::BadMagic(_))
        ));
        for cut in 0..good.len() {
            let r = Btf::from_bytes(good[..cut].to_vec());
            if let Ok(b) = r {
                let _ = b.field("s", "p");
            }
        }
        for i in 0..good.len() {
            for v in [0u8, 0xff, 0x7f, 0x80, 0x13] {
                let mut d = good.clone();
                d[i] = v;
                if let Ok(b) = Btf::from_bytes(d) {
                    let _ = b.field("s", "p");
                    let _ = b.field("s", "b");
                    let _ = b.func_id("f");
                }
            }
        }
        // A typedef loop: t -> t.
        let mut b = Builder::new();
        b.rec("t", kind::TYPEDEF, 0, false, 1);
        b.rec("s", kind::STRUCT, 1, false, 4);
        let m = b.s("m");
        for v in [m, 1, 0] {
            b.word(v);
        }
        let btf = Btf::from_bytes(b.bytes()).unwrap();
        assert!(matches!(
            btf.field("s", "m"),
            Err(BtfError::Unexpected { .. })
        ));
    }

    /// The running kernel's BTF, where there is one: the members the
    /// descriptor iterator reads are where the kernel's headers put them
    /// (sizes from `include/linux/fs.h`, `sched.h`, `mm_types.h`).
    #[test]
    fn vmlinux_has_the_iterator_members() {
        let Ok(btf) = Btf::vmlinux() else {
            eprintln!("no {VMLINUX_BTF}: skipped");
            return;
        };
        assert!(btf.func_id("bpf_iter_task_file").is_ok());
        for (s, m, size, ptr) in [
            ("file", "f_inode", 8, true),
            ("inode", "i_mode", 2, false),
            ("inode", "i_rdev", 4, false),
            ("inode", "i_ino", 8, false),
            ("inode", "i_sb", 8, true),
            ("super_block", "s_magic", 8, false),
            ("task_struct", "tgid", 4, false),
            ("task_struct", "pid", 4, false),
        ] {
            let f = btf.field(s, m).unwrap();
            assert_eq!((f.size, f.is_ptr), (size, ptr), "{s}.{m}");
        }
    }
}
