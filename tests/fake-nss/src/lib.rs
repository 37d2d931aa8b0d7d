//! A glibc NSS module for tests: the `passwd` database of the service
//! `gpufencetest` (nsswitch.conf(5): `passwd: files gpufencetest`) knows one
//! user, [`NAME`] (uid and gid [`UID`], home [`HOME`]), by uid, by name and
//! in enumeration. With `GPUFENCE_NSS_TEST_HANG=<seconds>` in the
//! environment every call first sleeps that long: an LDAP server that does
//! not answer.
//!
//! The entry points follow glibc's module interface (`_nss_<service>_<fn>`,
//! returning an `enum nss_status`; "NSS Module Function Internals" in the
//! glibc manual).

// The exported functions are the C ABI that NVML and glibc NSS define
// (their headers document each); the bodies read and write through the
// caller's pointers under that contract. This is a test double.
#![allow(
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks
)]

use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicBool, Ordering};

/// The one user's name.
pub const NAME: &str = "nssonly";
/// Its uid (and gid).
pub const UID: u32 = 4242;
/// Its home.
pub const HOME: &str = "/nonexistent";

const NSS_STATUS_TRYAGAIN: c_int = -2;
const NSS_STATUS_NOTFOUND: c_int = 0;
const NSS_STATUS_SUCCESS: c_int = 1;

/// Whether the enumeration has returned the user since `setpwent`.
static ENUMERATED: AtomicBool = AtomicBool::new(false);

fn hang() {
    if let Some(s) = std::env::var("GPUFENCE_NSS_TEST_HANG")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_secs(s));
    }
}

/// Fills `pw` with the user, its strings in `buf`.
///
/// # Safety
/// `pw` points to a writable passwd, `buf` to `len` writable bytes, `errnop`
/// to a writable int (glibc's arguments).
unsafe fn fill(pw: *mut libc::passwd, buf: *mut c_char, len: usize, errnop: *mut c_int) -> c_int {
    let fields = [NAME, "x", "NSS-only test user", HOME, "/bin/false"];
    let need: usize = fields.iter().map(|f| f.len() + 1).sum();
    if buf.is_null() || len < need {
        *errnop = libc::ERANGE;
        return NSS_STATUS_TRYAGAIN;
    }
    let mut at = buf;
    let mut ptrs = [std::ptr::null_mut::<c_char>(); 5];
    for (i, f) in fields.iter().enumerate() {
        std::ptr::copy_nonoverlapping(f.as_ptr().cast::<c_char>(), at, f.len());
        *at.add(f.len()) = 0;
        ptrs[i] = at;
        at = at.add(f.len() + 1);
    }
    (*pw).pw_name = ptrs[0];
    (*pw).pw_passwd = ptrs[1];
    (*pw).pw_uid = UID;
    (*pw).pw_gid = UID;
    (*pw).pw_gecos = ptrs[2];
    (*pw).pw_dir = ptrs[3];
    (*pw).pw_shell = ptrs[4];
    NSS_STATUS_SUCCESS
}

/// `getpwuid_r` of the service.
///
/// # Safety
/// glibc's arguments (see `fill`).
#[no_mangle]
pub unsafe extern "C" fn _nss_gpufencetest_getpwuid_r(
    uid: libc::uid_t,
    pw: *mut libc::passwd,
    buf: *mut c_char,
    len: usize,
    errnop: *mut c_int,
) -> c_int {
    hang();
    if uid != UID {
        return NSS_STATUS_NOTFOUND;
    }
    fill(pw, buf, len, errnop)
}

/// `getpwnam_r` of the service.
///
/// # Safety
/// glibc's arguments (see `fill`); `name` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn _nss_gpufencetest_getpwnam_r(
    name: *const c_char,
    pw: *mut libc::passwd,
    buf: *mut c_char,
    len: usize,
    errnop: *mut c_int,
) -> c_int {
    hang();
    if name.is_null() || CStr::from_ptr(name).to_bytes() != NAME.as_bytes() {
        return NSS_STATUS_NOTFOUND;
    }
    fill(pw, buf, len, errnop)
}

/// `setpwent` of the service: the enumeration starts over.
#[no_mangle]
pub extern "C" fn _nss_gpufencetest_setpwent(_stayopen: c_int) -> c_int {
    ENUMERATED.store(false, Ordering::SeqCst);
    NSS_STATUS_SUCCESS
}

/// `endpwent` of the service.
#[no_mangle]
pub extern "C" fn _nss_gpufencetest_endpwent() -> c_int {
    NSS_STATUS_SUCCESS
}

/// `getpwent_r` of the service: the user once, then not found.
///
/// # Safety
/// glibc's arguments (see `fill`).
#[no_mangle]
pub unsafe extern "C" fn _nss_gpufencetest_getpwent_r(
    pw: *mut libc::passwd,
    buf: *mut c_char,
    len: usize,
    errnop: *mut c_int,
) -> c_int {
    hang();
    if ENUMERATED.load(Ordering::SeqCst) {
        return NSS_STATUS_NOTFOUND;
    }
    let r = fill(pw, buf, len, errnop);
    if r == NSS_STATUS_SUCCESS {
        ENUMERATED.store(true, Ordering::SeqCst);
    }
    r
}
