//! `/proc/<pid>/stat`: the one parser of the fields gpufence reads
//! (`proc_pid_stat`, `fs/proc/array.c`; proc(5)).

use std::path::Path;

/// `PF_KTHREAD` (`include/linux/sched.h`): the `flags` bit of a kernel
/// thread.
pub const PF_KTHREAD: u64 = 0x0020_0000;

/// The fields of one `stat` line gpufence reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    /// `comm` (field 2) without its parentheses: it may hold spaces and
    /// `)` itself, so the line is split at its last `)`.
    pub comm: String,
    /// The state letter (field 3): `R`, `S`, `D`, `Z`, `X`, ...
    pub state: char,
    /// The parent's pid (field 4).
    pub ppid: i32,
    /// The `PF_*` flags (field 9), e.g. [`PF_KTHREAD`].
    pub flags: u64,
    /// The start time in clock ticks since boot (field 22): with the pid,
    /// which process it was.
    pub starttime: u64,
}

impl ProcStat {
    /// Parses one `stat` line; `None` when it is not one.
    pub fn parse(text: &str) -> Option<ProcStat> {
        let open = text.find('(')?;
        let close = text.rfind(')')?;
        let comm = text.get(open + 1..close)?.to_string();
        let rest: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
        // state ppid pgrp session tty_nr tpgid flags ... starttime (22)
        Some(ProcStat {
            comm,
            state: rest.first()?.chars().next()?,
            ppid: rest.get(1)?.parse().ok()?,
            flags: rest.get(6)?.parse().ok()?,
            starttime: rest.get(19)?.parse().ok()?,
        })
    }

    /// The `stat` of the task whose `/proc` directory is `dir`
    /// (`/proc/<pid>`, `/proc/<pid>/task/<tid>`, or a fixture tree's);
    /// `None` when it is gone or the file is not a `stat` line.
    pub fn read_at(dir: &Path) -> Option<ProcStat> {
        ProcStat::parse(&std::fs::read_to_string(dir.join("stat")).ok()?)
    }

    /// `/proc/<pid>/stat`; `None` when the process is gone.
    pub fn of(pid: i32) -> Option<ProcStat> {
        ProcStat::read_at(Path::new(&format!("/proc/{pid}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_comm_with_spaces_and_parentheses() {
        let line = "4242 (a) b) (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        assert_eq!(
            ProcStat::parse(line),
            Some(ProcStat {
                comm: "a) b) (c".into(),
                state: 'S',
                ppid: 1,
                flags: 4_194_560,
                starttime: 98_765,
            })
        );
    }

    #[test]
    fn this_process_reads_itself() {
        let me = ProcStat::of(std::process::id() as i32).unwrap();
        assert!(matches!(me.state, 'R' | 'S'), "{me:?}");
        assert_eq!(me.flags & PF_KTHREAD, 0);
        assert!(ProcStat::of(i32::MAX).is_none());
    }

    proptest::proptest! {
        /// Any text: a stat or `None`, never a panic.
        #[test]
        fn any_text_is_parsed_or_refused(s in "\\PC{0,200}") {
            let _ = ProcStat::parse(&s);
        }
    }
}
