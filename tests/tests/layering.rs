//! No import circle inside a crate: at every level of a crate's folders
//! (the crate's own top-level modules, then the files of each folder),
//! the modules import one another one way only. Read from the sources:
//! product code (what comes before a file's first `#[cfg(test)]`, comment
//! lines aside), every `crate::`, `super::` and `self::` path, `use`
//! lists with nested braces included. A module may use its parent and
//! its parent may use it (a folder's `mod.rs` declares and re-exports its
//! files); siblings, and the folders they are in, may not go round.
//!
//! Checked for `model`, `cgroup` and `node` (whose folders are also held
//! in their order by its own test, `layers::imports_go_one_way`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path inside its crate (`["iter", "fdtable"]`; the crate
/// root is empty), from its file.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

fn product_code(text: &str) -> String {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident(s: &str) -> usize {
    s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len())
}

fn skip_ws(s: &str, at: usize) -> usize {
    at + (s[at..].len() - s[at..].trim_start().len())
}

/// The paths of the use tree at the start of `s` (what follows `crate::`
/// or the like: `a::b`, `a::{b, c::{d, e as f}}`, `a::*`), each after
/// `prefix`, into `out`. Returns how many bytes it read.
fn use_tree(s: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix;
    let mut at = skip_ws(s, 0);
    loop {
        if s[at..].starts_with('{') {
            at += 1;
            loop {
                at = skip_ws(s, at);
                if at >= s.len() {
                    return at;
                }
                if s[at..].starts_with('}') {
                    return at + 1;
                }
                at += use_tree(&s[at..], path.clone(), out);
                at = skip_ws(s, at);
                if let Some(r) = s[at..].strip_prefix("as ") {
                    let r = r.trim_start();
                    at = s.len() - r.len() + ident(r);
                    at = skip_ws(s, at);
                }
                if s[at..].starts_with(',') {
                    at += 1;
                } else if s[at..].starts_with('}') {
                    return at + 1;
                } else {
                    return at;
                }
            }
        }
        let n = ident(&s[at..]);
        if n == 0 {
            out.push(path);
            return at;
        }
        let name = &s[at..at + n];
        if name != "self" {
            path.push(name.to_string());
        }
        at += n;
        if s[at..].starts_with("::") {
            at += 2;
        } else {
            out.push(path);
            return at;
        }
    }
}

/// Every module path `text` (of module `me`) names, as written.
fn named_paths(me: &[String], text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    for root in ["crate::", "super::", "self::"] {
        for (at, _) in text.match_indices(root) {
            if at > 0
                && (bytes[at - 1].is_ascii_alphanumeric()
                    || bytes[at - 1] == b'_'
                    || bytes[at - 1] == b':')
            {
                continue;
            }
            let mut base: Vec<String> = match root {
                "crate::" => Vec::new(),
                "super::" => me[..me.len().saturating_sub(1)].to_vec(),
                _ => me.to_vec(),
            };
            let mut rest = &text[at + root.len()..];
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            use_tree(rest, base, &mut out);
        }
    }
    out
}

/// The modules of crate `src` and, for each, the modules it names (the
/// longest module prefix of each path).
fn graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files: Vec<PathBuf> = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let mut g = BTreeMap::new();
    for f in &files {
        let me = module_of(src, f);
        let text = product_code(&std::fs::read_to_string(f).unwrap());
        let mut to = BTreeSet::new();
        for p in named_paths(&me, &text) {
            if let Some(m) = (1..=p.len())
                .rev()
                .map(|n| p[..n].to_vec())
                .find(|c| modules.contains(c))
            {
                to.insert(m);
            }
        }
        g.insert(me, to);
    }
    g
}

/// The circles among the children of each module: `a → b → a` where a
/// and b are files or folders side by side.
fn circles(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<String> {
    let parents: BTreeSet<Vec<String>> = g
        .keys()
        .filter(|m| !m.is_empty())
        .map(|m| m[..m.len() - 1].to_vec())
        .collect();
    let mut found = Vec::new();
    for p in &parents {
        // The child of `p` that module `m` is in, if any.
        let child = |m: &Vec<String>| -> Option<String> {
            (m.len() > p.len() && m[..p.len()] == p[..]).then(|| m[p.len()].clone())
        };
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, tos) in g {
            let Some(a) = child(from) else { continue };
            for to in tos {
                if let Some(b) = child(to) {
                    if a != b {
                        edges.entry(a.clone()).or_default().insert(b);
                    }
                }
            }
        }
        // Depth-first search; a back edge closes a circle.
        fn visit(
            n: &String,
            edges: &BTreeMap<String, BTreeSet<String>>,
            done: &mut BTreeSet<String>,
            path: &mut Vec<String>,
            found: &mut Vec<Vec<String>>,
        ) {
            if let Some(at) = path.iter().position(|x| x == n) {
                let mut c = path[at..].to_vec();
                c.push(n.clone());
                found.push(c);
                return;
            }
            if done.contains(n) {
                return;
            }
            path.push(n.clone());
            for m in edges.get(n).into_iter().flatten() {
                visit(m, edges, done, path, found);
            }
            path.pop();
            done.insert(n.clone());
        }
        let mut done = BTreeSet::new();
        let mut here = Vec::new();
        for n in edges.keys() {
            visit(n, &edges, &mut done, &mut Vec::new(), &mut here);
        }
        let at = if p.is_empty() {
            "the crate root".to_string()
        } else {
            p.join("/")
        };
        for c in here {
            found.push(format!("in {at}: {}", c.join(" → ")));
        }
    }
    found
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn no_import_circle_inside_the_kernel_and_model_crates() {
    let mut bad = Vec::new();
    for krate in ["model", "cgroup", "node"] {
        let g = graph(&root().join(krate).join("src"));
        assert!(g.len() > 10, "{krate}: only {} modules read", g.len());
        bad.extend(circles(&g).into_iter().map(|c| format!("{krate}: {c}")));
    }
    assert!(bad.is_empty(), "import circles:\n{}", bad.join("\n"));
}

#[test]
fn the_check_sees_nested_lists_and_relative_paths() {
    let me = vec!["fence".to_string(), "install".to_string()];
    let got = named_paths(
        &me,
        "use crate::{iter::{self, fdtable::Pass}, maps::X};\nuse super::bpffs::Lock;\nlet x = crate::sys::f();",
    );
    let s = |v: &[&str]| v.iter().map(|p| p.to_string()).collect::<Vec<_>>();
    assert_eq!(
        got,
        [
            s(&["iter"]),
            s(&["iter", "fdtable", "Pass"]),
            s(&["maps", "X"]),
            s(&["sys", "f"]),
            s(&["fence", "bpffs", "Lock"]),
        ]
    );
    // A circle of two siblings in a folder, and one through a folder.
    let m = |p: &str| -> Vec<String> {
        p.split('/')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    };
    let mut g = BTreeMap::new();
    g.insert(m(""), BTreeSet::from([m("a"), m("b")]));
    g.insert(m("a"), BTreeSet::from([m("b/c")]));
    g.insert(m("b"), BTreeSet::new());
    g.insert(m("b/c"), BTreeSet::from([m("b/d")]));
    g.insert(m("b/d"), BTreeSet::from([m("b/c"), m("a")]));
    let c = circles(&g);
    assert_eq!(
        c,
        ["in the crate root: a → b → a", "in b: c → d → c"],
        "{c:?}"
    );
}
