//! This node's name as Slurm names it: one answer for the user's lines
//! (`gpufence: job J step S refused on NODE`) and the drain
//! (`scontrol update nodename=NODE`).

/// The variable that names this node as Slurm does: slurmd sets it for the
/// Prolog and Epilog, and slurmstepd in its own environment before any
/// SPANK plugin runs (`setenvf(NULL, "SLURMD_NODENAME", ...)` in
/// `src/slurmd/slurmstepd/slurmstepd.c`, 22.05 and later).
pub const NODENAME_ENV: &str = "SLURMD_NODENAME";

/// This node as Slurm names it: `slurm_node` (slurmd's `-N`, where the
/// caller read it), else `$SLURMD_NODENAME`, else the host name up to its
/// first dot (what slurmd without `-N` looks its node up by), else
/// `localhost`. Empty values count as unset.
pub fn node_name(slurm_node: Option<&str>) -> String {
    slurm_node
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .or_else(|| std::env::var(NODENAME_ENV).ok().filter(|n| !n.is_empty()))
        .or_else(short_hostname)
        .unwrap_or_else(|| "localhost".into())
}

/// The host name (`gethostname(2)`) up to its first dot; `None` when the
/// call fails or the name is empty.
pub fn short_hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname into a buffer we own, with its length.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let full = String::from_utf8_lossy(&buf[..end]).into_owned();
    let short = full.split('.').next().unwrap_or_default();
    (!short.is_empty()).then(|| short.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurms_name_first_then_the_short_host_name() {
        assert_eq!(node_name(Some("gfn7")), "gfn7");
        let host = short_hostname().unwrap();
        assert!(!host.contains('.'), "{host}");
        // The environment is the process's: only what holds either way.
        match std::env::var(NODENAME_ENV).ok().filter(|n| !n.is_empty()) {
            Some(n) => assert_eq!(node_name(None), n),
            None => assert_eq!(node_name(Some("")), host),
        }
    }
}
