//! `/proc/<pid>/net/tcp` and `/proc/<pid>/net/tcp6`: the TCP sockets of a
//! network namespace, as `gpufence sweep` reads them (wildcard listeners,
//! connections to mining-pool ports).
//!
//! Format (`tcp4_seq_show` in `net/ipv4/tcp_ipv4.c`, `tcp6_seq_show` in
//! `net/ipv6/tcp_ipv6.c`): a header line starting with `sl`, then one line
//! per socket:
//!
//! ```text
//!   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
//!    0: 0100007F:0CEA 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 ...
//! ```
//!
//! Addresses are the kernel's `__be32` words printed with `%08X` as native
//! integers (so `0100007F` is 127.0.0.1 on little-endian hosts), four such
//! words for IPv6; the port is printed after `ntohs`, in hex. A line that
//! does not have this shape is an error naming the file and the line: a
//! table that cannot be read is reported, never skipped silently.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use crate::error::ParseError;

/// `TCP_ESTABLISHED` (`include/net/tcp_states.h`).
pub const TCP_ESTABLISHED: u8 = 1;
/// `TCP_SYN_SENT`.
pub const TCP_SYN_SENT: u8 = 2;
/// `TCP_LISTEN`.
pub const TCP_LISTEN: u8 = 10;

/// One socket of a TCP table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpEntry {
    /// Local address and port.
    pub local: SocketAddr,
    /// Remote address and port (unspecified, port 0, for a listener).
    pub remote: SocketAddr,
    /// The TCP state (`TCP_*`, 1..=12).
    pub state: u8,
    /// The socket's owner.
    pub uid: u32,
    /// The socket inode (`socket:[N]` in `/proc/<pid>/fd`).
    pub inode: u64,
}

fn hex_u32(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 8 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

/// `ADDR:PORT` as the kernel prints it: 8 hex digits (IPv4) or 32 (IPv6).
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    if port.len() != 4 {
        return None;
    }
    let port = u16::try_from(hex_u32(port)?).ok()?;
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(hex_u32(ip)?.to_ne_bytes())),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_mut(4).enumerate() {
                let w = hex_u32(ip.get(i * 8..i * 8 + 8)?)?;
                chunk.copy_from_slice(&w.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Parses a `net/tcp` or `net/tcp6` table read from `source`.
///
/// # Errors
/// A [`ParseError`] naming `source` and the 1-based line: a missing
/// header, a line with too few fields, or a field that is not what the
/// kernel prints.
pub fn parse_tcp(text: &str, source: &Path) -> Result<Vec<TcpEntry>, ParseError> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, h)) if h.trim_start().starts_with("sl ") => {}
        None => return Ok(out),
        Some((_, h)) => {
            return Err(ParseError::new(
                source,
                1,
                format!("expected the header line (\"sl local_address ...\"), found {h:?}"),
            ))
        }
    }
    for (i, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let err = |what: &str| {
            let shown: String = line.chars().take(120).collect();
            ParseError::new(source, i + 1, format!("{what} in {shown:?}"))
        };
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 {
            return Err(err("fewer than 10 fields"));
        }
        if !f[0].ends_with(':') || f[0][..f[0].len() - 1].parse::<u64>().is_err() {
            return Err(err("no slot number"));
        }
        let local = parse_addr(f[1]).ok_or_else(|| err("bad local address"))?;
        let remote = parse_addr(f[2]).ok_or_else(|| err("bad remote address"))?;
        if local.is_ipv4() != remote.is_ipv4() {
            return Err(err("local and remote addresses of different families"));
        }
        let state = hex_u32(f[3])
            .filter(|s| (1..=12).contains(s) && f[3].len() == 2)
            .ok_or_else(|| err("bad state"))? as u8;
        let uid: u32 = f[7].parse().map_err(|_| err("bad uid"))?;
        let inode: u64 = f[9].parse().map_err(|_| err("bad inode"))?;
        out.push(TcpEntry {
            local,
            remote,
            state,
            uid,
            inode,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";

    fn v4(a: [u8; 4]) -> String {
        format!("{:08X}", u32::from_ne_bytes(a))
    }

    fn v6(a: Ipv6Addr) -> String {
        a.octets()
            .chunks(4)
            .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
            .collect()
    }

    fn line(slot: u32, local: &str, remote: &str, st: u8, uid: u32, inode: u64) -> String {
        format!(
            "{slot:4}: {local} {remote} {st:02X} 00000000:00000000 00:00000000 00000000 {uid:5}        0 {inode} 1 0000000000000000 100 0 0 10 0"
        )
    }

    #[test]
    fn real_shapes() {
        let text = format!(
            "{HEADER}\n{}\n{}\n",
            line(
                0,
                &format!("{}:0CEA", v4([127, 0, 0, 1])),
                &format!("{}:0000", v4([0; 4])),
                10,
                1000,
                4242
            ),
            line(
                1,
                &format!("{}:9C40", v4([10, 1, 2, 3])),
                &format!("{}:0D05", v4([192, 0, 2, 7])),
                1,
                0,
                7
            ),
        );
        let t = parse_tcp(&text, Path::new("/proc/1/net/tcp")).unwrap();
        assert_eq!(t[0].local, "127.0.0.1:3306".parse().unwrap());
        assert_eq!((t[0].state, t[0].uid, t[0].inode), (TCP_LISTEN, 1000, 4242));
        assert!(t[0].remote.ip().is_unspecified());
        assert_eq!(t[1].remote, "192.0.2.7:3333".parse().unwrap());
        assert_eq!(t[1].state, TCP_ESTABLISHED);
        let a: Ipv6Addr = "2001:db8::1".parse().unwrap();
        let text6 = format!(
            "{HEADER}\n{}\n",
            line(
                0,
                &format!("{}:1F90", v6(a)),
                &format!("{}:0000", v6(Ipv6Addr::UNSPECIFIED)),
                10,
                5,
                9
            )
        );
        let t = parse_tcp(&text6, Path::new("tcp6")).unwrap();
        assert_eq!(t[0].local, SocketAddr::new(IpAddr::V6(a), 8080));
        assert_eq!(parse_tcp("", Path::new("x")).unwrap(), vec![]);
        assert_eq!(
            parse_tcp(&format!("{HEADER}\n"), Path::new("x")).unwrap(),
            vec![]
        );
    }

    #[test]
    fn malformed_lines_name_file_and_line() {
        let good = line(0, "0100007F:0CEA", "00000000:0000", 10, 0, 1);
        for (bad, what) in [
            (
                good.replace("0100007F:0CEA", "0100007F:CEA"),
                "local address",
            ),
            (
                good.replace("0100007F:0CEA", "0100007G:0CEA"),
                "local address",
            ),
            (
                good.replace("00000000:0000", "0000000000000000000000000000000:0000"),
                "remote address",
            ),
            (good.replace(" 0A ", " 0F "), "state"),
            (
                good.replace("   0        0 1 1", "  -1        0 1 1"),
                "uid",
            ),
            ("   3: 0100007F:0CEA".to_string(), "fewer than 10 fields"),
            (good.replace("   0:", "   x:"), "slot"),
        ] {
            let e = parse_tcp(
                &format!("{HEADER}\n{good}\n{bad}\n"),
                Path::new("/proc/7/net/tcp"),
            )
            .unwrap_err();
            assert_eq!(e.line, 3, "{bad}: {e}");
            assert!(
                e.to_string().starts_with("/proc/7/net/tcp:3: ") && e.msg.contains(what),
                "{e}"
            );
        }
        let e = parse_tcp("garbage\n", Path::new("t")).unwrap_err();
        assert_eq!(e.line, 1);
    }

    proptest::proptest! {
        #[test]
        fn never_panics_and_names_the_line(s in "\\PC{0,400}") {
            for text in [s.clone(), format!("{HEADER}\n{s}")] {
                if let Err(e) = parse_tcp(&text, Path::new("f")) {
                    proptest::prop_assert_eq!(e.source_name.as_path(), Path::new("f"));
                    proptest::prop_assert!(e.line >= 1 && e.line <= text.lines().count(), "{}", e);
                }
            }
        }

        #[test]
        fn near_misses_round_trip_or_name_the_line(
            rows in proptest::collection::vec(
                (
                    proptest::prelude::any::<[u8; 4]>(),
                    proptest::prelude::any::<u16>(),
                    proptest::prelude::any::<[u8; 16]>(),
                    0u8..14,
                    proptest::prelude::any::<u32>(),
                    proptest::prelude::any::<u64>(),
                    proptest::prelude::any::<bool>(),
                    0usize..80,
                ),
                0..6,
            )
        ) {
            let mut text = format!("{HEADER}\n");
            let mut want = Vec::new();
            for (i, (a4, port, a6, st, uid, inode, six, cut)) in rows.iter().enumerate() {
                let (l, r, local) = if *six {
                    let ip = Ipv6Addr::from(*a6);
                    (format!("{}:{port:04X}", v6(ip)), format!("{}:0000", v6(Ipv6Addr::UNSPECIFIED)), SocketAddr::new(IpAddr::V6(ip), *port))
                } else {
                    (format!("{}:{port:04X}", v4(*a4)), format!("{}:0000", v4([0; 4])), SocketAddr::new(IpAddr::V4(Ipv4Addr::from(*a4)), *port))
                };
                let mut ln = line(i as u32, &l, &r, *st, *uid, *inode);
                // Some rows are cut short: those must be the error's line.
                let cut_here = *cut < ln.len() && *cut % 5 == 0;
                if cut_here {
                    ln.truncate(*cut);
                }
                let ok = !cut_here && (1..=12).contains(st);
                let empty = ln.trim().is_empty();
                want.push((ok || empty, empty, local, *st, *uid, *inode));
                text.push_str(&ln);
                text.push('\n');
            }
            match parse_tcp(&text, Path::new("/proc/net/tcp")) {
                Ok(t) => {
                    proptest::prop_assert!(want.iter().all(|w| w.0));
                    let expect: Vec<_> = want.iter().filter(|w| !w.1).collect();
                    proptest::prop_assert_eq!(t.len(), expect.len());
                    for (e, w) in t.iter().zip(expect) {
                        proptest::prop_assert_eq!((e.local, e.state, e.uid, e.inode), (w.2, w.3, w.4, w.5));
                    }
                }
                Err(e) => {
                    proptest::prop_assert!(e.line >= 2, "{}", e);
                    proptest::prop_assert!(!want[e.line - 2].0, "line {} was good: {}", e.line, e);
                }
            }
        }
    }
}
