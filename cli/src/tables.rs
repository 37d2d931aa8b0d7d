//! How the CLI prints for a person: aligned tables whose cells a user
//! cannot split, and the device and doctor reports.

/// A value for a table cell: control characters (a tab, a newline in a
/// process name a user chose, or a cgroup name) become `?`, so a cell
/// cannot split a column or forge a line
/// ([`gpufence_model::text::printable`]).
pub(crate) fn cell(s: &str) -> String {
    gpufence_model::text::printable(s)
}

/// Prints tab-separated `rows` (the first is the header) as aligned
/// columns, each as wide as its widest cell (cells pass through [`cell`]
/// where a user chooses them).
pub(crate) fn print_table(rows: &[String]) {
    use std::io::Write;
    let mut tw = tabwriter::TabWriter::new(Vec::new()).padding(2);
    for r in rows {
        let _ = writeln!(tw, "{r}");
    }
    if let Ok(bytes) = tw.into_inner() {
        let _ = std::io::stdout().write_all(&bytes);
    }
}

pub(crate) fn print_devices(d: &gpufence_node::host::inventory::Devices) {
    if d.gpus.is_empty() {
        println!("no NVIDIA GPU found in the driver's /proc files");
    }
    for g in &d.gpus {
        println!(
            "GPU minor {}  {}  {}  {}",
            g.minor, g.pci_bus_id, g.uuid, g.model
        );
        println!(
            "  device file: {}   MIG: {}",
            g.device_file
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "(none)".into()),
            g.mig_mode
        );
        for m in &g.mig {
            println!(
                "  MIG gi {}{}  cap minor {}  {}",
                m.gi,
                m.ci.map(|c| format!(" ci {c}")).unwrap_or_default(),
                m.cap_minor,
                m.device_file
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "(no device file)".into())
            );
        }
        for (uuid, profile) in &g.nvml_mig_devices {
            println!("  NVML MIG device {uuid}  {profile}");
        }
    }
    for (name, minor) in &d.mig_admin_caps {
        println!(
            "MIG {name} capability: minor {minor} (never granted{})",
            if name == "monitor" {
                " unless grant_mig_monitor"
            } else {
                ""
            }
        );
    }
    println!("protected majors:");
    for m in &d.majors {
        println!(
            "  {} {}  {} device file(s)",
            m.major,
            m.names.join(","),
            m.files.len()
        );
        for f in &m.files {
            println!("      {}", f.display());
        }
    }
    if let Some(w) = &d.nvml_unavailable {
        println!("NVML: unavailable ({w})");
    }
    for e in &d.errors {
        println!("error: {e}");
    }
}

pub(crate) fn print_doctor(d: &gpufence_node::admin::doctor::Doctor) {
    // Cgroup names (users name their own under a delegated subtree) and
    // program names: through the one sanitiser, a line at a time.
    macro_rules! say {
        ($($t:tt)*) => {
            println!("{}", gpufence_model::text::printable(&format!($($t)*)))
        };
    }
    match d.pid {
        Some(p) => say!("process {p} in cgroup /{}", d.cgroup),
        None => say!("cgroup /{}", d.cgroup),
    }
    say!(
        "fence: {}{}; running mode {} (config: {}); {}",
        if d.fence_attached {
            "attached"
        } else {
            "NOT attached"
        },
        d.fence_problem
            .as_ref()
            .map(|p| format!(" ({p})"))
            .unwrap_or_default(),
        d.running_mode,
        d.mode,
        match d.fence_current {
            Some(true) => "the program is the one the config asks for",
            Some(false) =>
                "the program is NOT the one the config asks for: run `gpufence fence install`",
            None => "currency unknown",
        }
    );
    if !d.under_fence {
        say!("this cgroup is outside the fenced subtree: gpufence does not apply to it");
    }
    match (d.mount_root_level, d.kernel_level) {
        (Some(n), Some(k)) if n > 0 => say!(
            "cgroup namespace: paths here start {n} level(s) below the hierarchy's root; this cgroup is at kernel level {k}"
        ),
        (None, _) => say!("kernel level: unknown (see the verdicts)"),
        _ => {}
    }
    say!("device programs from the root down:");
    if d.levels.is_empty() {
        say!("  (none attached from the root down to this cgroup)");
    }
    for l in &d.levels {
        say!("  /{} (attach flags: {})", l.cgroup, l.attach_flags);
        for p in &l.programs {
            say!(
                "    prog {} {:<16} tag {} loaded by uid {} {}  -> {}",
                p.id,
                p.name,
                p.tag,
                p.loaded_by_uid,
                if p.effective {
                    "[runs for this target]"
                } else {
                    "[not effective here]"
                },
                p.owner
            );
        }
    }
    say!("NVIDIA devices (read+write, as every program that runs for this target answers):");
    for v in &d.devices {
        say!("  {:<8} {:<8} {}  ({})", v.device, v.verdict, v.why, v.path);
        if v.programs.len() > 1 {
            for p in &v.programs {
                say!(
                    "           prog {} {}: {}{}",
                    p.id,
                    p.name,
                    p.answer,
                    if p.why.is_empty() || p.owner.starts_with("gpufence") {
                        String::new()
                    } else {
                        format!(" ({})", p.why)
                    }
                );
            }
        }
    }
    if let Some(n) = &d.io_uring {
        say!("note: {n}");
    }
    for w in &d.warnings {
        say!("warning: {w}");
    }
}
