//! gpufence's manual pages.
//!
//! The admin commands (`gpufence`, its subcommands, `gpufence-prolog`,
//! `gpufence-epilog`) are section 8 (system administration, man-pages(7)):
//! their NAME, SYNOPSIS, DESCRIPTION, OPTIONS and SUBCOMMANDS come from the
//! clap definitions ([`clap_mangen`]), followed by the sections an admin
//! reads a page for ([`Extra`]): EXIT STATUS, FILES, ENVIRONMENT, EXAMPLES
//! and SEE ALSO. `gpufence.toml(5)` is rendered from the shipped example
//! configuration, whose comments document every key and which a test of
//! `gpufence-model` keeps equal to the defaults ([`config_page`]).

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use roff::{bold, italic, roman, Roff};

/// The admin commands' section (man-pages(7): system administration).
pub const ADMIN_SECTION: &str = "8";

/// The files the Prolog and the Epilog read and write (the defaults;
/// each is a key of gpufence.toml(5)).
pub const JOB_SCRIPT_FILES: &[(&str, &str)] = &[
    (
        "/etc/slurm/gpufence.toml",
        "The configuration, gpufence.toml(5).",
    ),
    (
        "/run/gpufence/jobs/<job>.json",
        "The job's record (state_dir).",
    ),
    (
        "/var/log/gpufence/audit.jsonl",
        "The audit log (audit_log).",
    ),
    (
        "/var/lib/gpufence/evidence/",
        "Evidence of processes a response acted on (evidence_dir).",
    ),
    (
        "<job_map_dir>/<index>[.<gi>]",
        "When job_map_dir is set: the jobs on the GPU of that NVML index (or MIG slice), one per line, for GPU exporters.",
    ),
];

/// `pages` as a SEE ALSO list.
pub fn see_also(pages: &[&str]) -> Vec<String> {
    pages.iter().map(|s| s.to_string()).collect()
}

/// What a page says besides its command line: each a list of (term,
/// description) pairs, in the order `man` shows them.
#[derive(Clone, Debug, Default)]
pub struct Extra {
    /// EXIT STATUS: (code, meaning).
    pub exit_status: &'static [(&'static str, &'static str)],
    /// FILES: (path, what it is).
    pub files: &'static [(&'static str, &'static str)],
    /// ENVIRONMENT: (variable, what it is).
    pub environment: &'static [(&'static str, &'static str)],
    /// EXAMPLES: (command, what it does).
    pub examples: &'static [(&'static str, &'static str)],
    /// SEE ALSO: pages, as `name(section)`.
    pub see_also: Vec<String>,
}

/// Renders `cmd`'s page in section `section` with `extra` after the
/// sections clap gives, into `w`.
///
/// # Errors
/// The writer's.
pub fn render(
    cmd: &clap::Command,
    section: &str,
    extra: &Extra,
    w: &mut dyn Write,
) -> io::Result<()> {
    let man = clap_mangen::Man::new(cmd.clone())
        .section(section)
        .manual("gpufence");
    man.render_title(w)?;
    man.render_name_section(w)?;
    man.render_synopsis_section(w)?;
    man.render_description_section(w)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(w)?;
    }
    if cmd.has_subcommands() {
        man.render_subcommands_section(w)?;
    }
    let mut roff = Roff::default();
    for (title, items) in [
        ("EXIT STATUS", extra.exit_status),
        ("FILES", extra.files),
        ("ENVIRONMENT", extra.environment),
        ("EXAMPLES", extra.examples),
    ] {
        if items.is_empty() {
            continue;
        }
        roff.control("SH", [title]);
        for (term, text) in items {
            roff.control("TP", []);
            roff.text([bold(*term)]);
            roff.text([roman(*text)]);
        }
    }
    if !extra.see_also.is_empty() {
        roff.control("SH", ["SEE ALSO"]);
        let mut parts = Vec::new();
        for (i, page) in extra.see_also.iter().enumerate() {
            if i > 0 {
                parts.push(roman(", "));
            }
            parts.push(bold(page.as_str()));
        }
        roff.text(parts);
    }
    roff.to_writer(w)
}

/// Writes `cmd`'s page and one per visible subcommand (named as clap_mangen
/// names them: `gpufence-fence.8`, `gpufence-fence-install.8`) into `dir`,
/// all in section `section`. `extra` goes on the command's own page;
/// `sub_extra` gives a subcommand's by its full name (`gpufence-sweep`),
/// SEE ALSO pointing back at the command when it gives none. Returns the
/// files written.
///
/// # Errors
/// The file system's.
pub fn write_pages(
    cmd: clap::Command,
    section: &str,
    extra: &Extra,
    sub_extra: &dyn Fn(&str) -> Option<Extra>,
    dir: &Path,
) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let top = cmd.get_name().to_string();
    let mut out = Vec::new();
    write_tree(&cmd, section, extra, sub_extra, &top, dir, &mut out)?;
    Ok(out)
}

fn write_tree(
    cmd: &clap::Command,
    section: &str,
    extra: &Extra,
    sub_extra: &dyn Fn(&str) -> Option<Extra>,
    top: &str,
    dir: &Path,
    out: &mut Vec<PathBuf>,
) -> io::Result<()> {
    let name = cmd
        .get_display_name()
        .unwrap_or_else(|| cmd.get_name())
        .to_string();
    let own = if name == top {
        extra.clone()
    } else {
        sub_extra(&name).unwrap_or(Extra {
            see_also: vec![format!("{top}({section})")],
            ..Extra::default()
        })
    };
    let path = dir.join(format!("{name}.{section}"));
    let mut f = std::fs::File::create(&path)?;
    render(cmd, section, &own, &mut f)?;
    f.flush()?;
    out.push(path);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_tree(sub, section, extra, sub_extra, top, dir, out)?;
    }
    Ok(())
}

/// gpufence.toml(5), from the shipped example configuration `example`
/// (`contrib/gpufence.toml`): its `# --- Title ---` lines become
/// subsections, each `key = value` line (or commented-out `# key = value`
/// of an optional key) an entry with its default, and the comment lines
/// above it the entry's text.
pub fn config_page(example: &str, w: &mut dyn Write) -> io::Result<()> {
    let mut roff = Roff::default();
    roff.control("TH", ["GPUFENCE.TOML", "5", "", "gpufence", "gpufence"]);
    roff.control("SH", ["NAME"]);
    roff.text([roman(
        "gpufence.toml - configuration of the gpufence GPU fence",
    )]);
    roff.control("SH", ["SYNOPSIS"]);
    roff.text([
        italic("/etc/slurm/gpufence.toml"),
        roman(", or the file named by "),
        bold("GPUFENCE_CONFIG"),
        roman(" or "),
        bold("--config"),
    ]);
    roff.control("SH", ["DESCRIPTION"]);
    roff.text([roman(
        "A TOML file read by gpufence(8), gpufence-prolog(8), gpufence-epilog(8) and the SPANK plugin \
         gpufence.so (its config= argument in plugstack.conf). Every key is optional; an absent key \
         takes the default shown. An unknown key, a value of the wrong type and a relative path are \
         errors that name the file, the line and the key. The keys, with their defaults:",
    )]);
    let mut comment: Vec<String> = Vec::new();
    let mut lines = example.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim();
        if let Some(title) = t
            .strip_prefix("# ---")
            .and_then(|r| r.strip_suffix("---"))
            .map(str::trim)
        {
            roff.control("SS", [title]);
            comment.clear();
            continue;
        }
        if t.is_empty() {
            comment.clear();
            continue;
        }
        let (entry, optional) = match t.strip_prefix('#') {
            Some(c) if key_line(c.trim()).is_some() || table_line(c.trim()).is_some() => {
                (c.trim(), true)
            }
            Some(c) => {
                comment.push(c.trim().to_string());
                continue;
            }
            None => (t, false),
        };
        if let Some(table) = table_line(entry) {
            // A table: its example entries follow, up to a blank line.
            let mut example = vec![entry.to_string()];
            while let Some(next) = lines.peek().map(|l| l.trim()) {
                if next.is_empty() {
                    break;
                }
                example.push(next.trim_start_matches('#').trim().to_string());
                lines.next();
            }
            roff.control("TP", []);
            roff.text([
                bold(format!("[{table}]")),
                roman(if optional { " (unset by default)" } else { "" }),
            ]);
            roff.text([roman(comment.join(" "))]);
            roff.control("IP", []);
            roff.text([roman(format!("Example: {}", example.join("; ")))]);
            comment.clear();
            continue;
        }
        let Some(key) = key_line(entry) else {
            continue;
        };
        let mut value = entry[key.len()..]
            .trim_start()
            .trim_start_matches('=')
            .trim()
            .to_string();
        // A multi-line array, up to its closing bracket.
        if value == "[" {
            for next in lines.by_ref() {
                let n = next.trim().trim_start_matches('#').trim();
                value.push_str(n);
                if n.starts_with(']') {
                    break;
                }
                value.push(' ');
            }
        }
        roff.control("TP", []);
        roff.text([
            bold(key),
            roman(if optional {
                " (unset by default; example: "
            } else {
                " = "
            }),
            roman(value),
            roman(if optional { ")" } else { "" }),
        ]);
        roff.text([roman(comment.join(" "))]);
        comment.clear();
    }
    roff.control("SH", ["SEE ALSO"]);
    roff.text([
        bold("gpufence(8)"),
        roman(", "),
        bold("gpufence-prolog(8)"),
        roman(", "),
        bold("gpufence-epilog(8)"),
        roman(", "),
        bold("slurm.conf(5)"),
        roman(", "),
        bold("gres.conf(5)"),
    ]);
    roff.to_writer(w)
}

/// The name of a `[table]` line, if it is one.
fn table_line(line: &str) -> Option<&str> {
    line.strip_prefix('[')?
        .strip_suffix(']')
        .filter(|n| n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
}

/// The key of a `key = value` line (a TOML bare key), if it is one.
fn key_line(line: &str) -> Option<&str> {
    let (k, v) = line.split_once('=')?;
    let k = k.trim();
    (!k.is_empty()
        && !v.trim().is_empty()
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'))
    .then_some(k)
}

/// Writes gpufence.toml(5) ([`config_page`]) into `dir` as
/// `gpufence.toml.5`.
///
/// # Errors
/// The file system's.
pub fn write_config_page(example: &str, dir: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("gpufence.toml.5");
    let mut f = std::fs::File::create(&path)?;
    config_page(example, &mut f)?;
    f.flush()?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../contrib/gpufence.toml");

    #[test]
    fn every_key_of_the_example_is_on_the_config_page() {
        let mut page = Vec::new();
        config_page(EXAMPLE, &mut page).unwrap();
        let page = String::from_utf8(page).unwrap();
        let mut keys = 0;
        let mut in_table = false;
        for line in EXAMPLE.lines() {
            let t = line.trim().trim_start_matches('#').trim();
            if t.is_empty() {
                in_table = false;
            } else if let Some(table) = table_line(t) {
                in_table = true;
                assert!(
                    page.contains(&format!("\\fB[{table}]\\fR")),
                    "[{table}] missing"
                );
            } else if let Some(k) = key_line(t).filter(|_| !in_table) {
                keys += 1;
                assert!(
                    page.contains(&format!("\\fB{k}\\fR")),
                    "{k} missing from gpufence.toml(5)"
                );
            }
        }
        assert!(keys > 40, "{keys} keys read");
        assert!(page.contains("\n.TH GPUFENCE.TOML 5"), "{page}");
        assert!(page.contains("protected_uid_max"));
    }

    #[test]
    fn a_page_has_the_sections_an_admin_reads() {
        let cmd = clap::Command::new("tool")
            .about("does things")
            .arg(clap::Arg::new("x").long("x"))
            .subcommand(clap::Command::new("sub").about("a part"));
        let extra = Extra {
            exit_status: &[("0", "fine"), ("1", "not")],
            files: &[("/etc/x", "its config")],
            environment: &[("X", "a variable")],
            examples: &[("tool --x 1", "does it once")],
            see_also: vec!["other(8)".into(), "more(5)".into()],
        };
        let d = tempfile::tempdir().unwrap();
        let files = write_pages(cmd, ADMIN_SECTION, &extra, &|_| None, d.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["tool.8", "tool-sub.8"]);
        let top = std::fs::read_to_string(&files[0]).unwrap();
        for s in [
            "EXIT STATUS",
            "FILES",
            "ENVIRONMENT",
            "EXAMPLES",
            "SEE ALSO",
            "OPTIONS",
        ] {
            assert!(
                top.contains(&format!(".SH \"{s}\"")) || top.contains(&format!(".SH {s}")),
                "{s}:\n{top}"
            );
        }
        assert!(
            top.starts_with(".ie") || top.contains(".TH tool 8"),
            "{top}"
        );
        let sub = std::fs::read_to_string(&files[1]).unwrap();
        assert!(sub.contains("tool(8)"), "points back: {sub}");
    }
}
