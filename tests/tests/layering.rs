//! No import circle inside a crate: at every level of a crate's folders
//! (the crate's own top-level modules, then the files of each folder),
//! the modules import one another one way only. Read from the sources:
//! product code (what comes before a file's first `#[cfg(test)]` module, comment
//! lines aside), every `crate::`, `super::` and `self::` path, `use`
//! lists with nested braces included. A module may use its parent and
//! its parent may use it (a folder's `mod.rs` declares and re-exports its
//! files); siblings, and the folders they are in, may not go round.
//!
//! Checked for `model`, `cgroup` and `node` (whose folders are also held
//! in their order by its own test, `layers::imports_go_one_way`).
//!
//! What comes after a file's first test module is read as tests: so no
//! product item may follow a `#[cfg(test)]` module, in any crate of the
//! workspace (`no_product_item_follows_a_test_module`, reading each file
//! as Rust items with `syn`).

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

/// `text` up to its first `#[cfg(test)]` module (what follows it is
/// tests: [`items_after_test_module`]), comment lines aside. A
/// `#[cfg(test)]` item that is not a module (a test-only static) does not
/// end the product code.
fn product_code(text: &str) -> String {
    let code = &text[..first_test_module(text).unwrap_or(text.len())];
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Where the first `#[cfg(test)]` module of `text` starts: a line
/// `#[cfg(test)]` whose item, after any further attributes and comments,
/// is a `mod`.
fn first_test_module(text: &str) -> Option<usize> {
    let mut at = 0;
    let mut lines = text.split_inclusive('\n');
    while let Some(l) = lines.next() {
        if l.trim_end() == "#[cfg(test)]" {
            let item = lines
                .clone()
                .map(str::trim_start)
                .find(|l| !l.starts_with("#[") && !l.starts_with("//"));
            if item.is_some_and(|i| i.starts_with("mod ") || i.starts_with("pub mod ")) {
                return Some(at);
            }
        }
        at += l.len();
    }
    None
}

/// Has `attrs` a `#[cfg(test)]`?
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "test")
    })
}

/// The items of `text` (a Rust file) that follow a `#[cfg(test)]` module
/// and are not `#[cfg(test)]` themselves, each as `kind name`: product
/// code where the readers of product code (above) do not look.
fn items_after_test_module(text: &str) -> Result<Vec<String>, syn::Error> {
    let file = syn::parse_file(text)?;
    let mut after = false;
    let mut found = Vec::new();
    for item in &file.items {
        let (attrs, what): (&[syn::Attribute], String) = match item {
            syn::Item::Mod(m) => (&m.attrs, format!("mod {}", m.ident)),
            syn::Item::Fn(f) => (&f.attrs, format!("fn {}", f.sig.ident)),
            syn::Item::Struct(s) => (&s.attrs, format!("struct {}", s.ident)),
            syn::Item::Enum(e) => (&e.attrs, format!("enum {}", e.ident)),
            syn::Item::Const(c) => (&c.attrs, format!("const {}", c.ident)),
            syn::Item::Static(s) => (&s.attrs, format!("static {}", s.ident)),
            syn::Item::Type(t) => (&t.attrs, format!("type {}", t.ident)),
            syn::Item::Trait(t) => (&t.attrs, format!("trait {}", t.ident)),
            syn::Item::Impl(i) => (&i.attrs, "impl".to_string()),
            syn::Item::Use(u) => (&u.attrs, "use".to_string()),
            syn::Item::Macro(m) => (&m.attrs, "macro".to_string()),
            syn::Item::Union(u) => (&u.attrs, format!("union {}", u.ident)),
            syn::Item::ExternCrate(e) => (&e.attrs, format!("extern crate {}", e.ident)),
            syn::Item::ForeignMod(f) => (&f.attrs, "extern block".to_string()),
            syn::Item::TraitAlias(t) => (&t.attrs, format!("trait {}", t.ident)),
            _ => (&[], "item".to_string()),
        };
        if is_test(attrs) {
            after |= matches!(item, syn::Item::Mod(_));
        } else if after {
            found.push(what);
        }
    }
    Ok(found)
}

/// The `.rs` files under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
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
    files.sort();
    files
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
    let files = rust_files(src);
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

/// Every crate's sources (its `src/`, and `tests/`' own test files): no
/// product item after a test module.
#[test]
fn no_product_item_follows_a_test_module() {
    let mut bad = Vec::new();
    let mut read = 0;
    let members = [
        "model",
        "cgroup",
        "node",
        "prolog",
        "epilog",
        "cli",
        "spank-plugin",
        "man",
        "bench",
        "tests",
    ];
    for krate in members {
        for f in rust_files(&root().join(krate).join("src")) {
            let text = std::fs::read_to_string(&f).unwrap();
            read += 1;
            match items_after_test_module(&text) {
                Ok(items) if items.is_empty() => {}
                Ok(items) => bad.push(format!("{}: {}", f.display(), items.join(", "))),
                Err(e) => bad.push(format!("{}: not read as Rust: {e}", f.display())),
            }
        }
    }
    assert!(read > 100, "only {read} files read");
    assert!(
        bad.is_empty(),
        "product items after a #[cfg(test)] module (the layering test does not read them):\n{}",
        bad.join("\n")
    );
}

/// The check catches an item after a test module, and passes test-only
/// items there and a test-only item that is not a module before product
/// code; the product code read for imports ends at the test module.
#[test]
fn the_check_sees_product_code_after_tests() {
    let text = "use crate::a::X;\n\n#[cfg(test)]\nthread_local! { static T: u8 = 0; }\n\nfn f() { crate::b::g() }\n\n#[cfg(test)]\n/// Tests.\nmod tests {\n    use super::*;\n    const S: &str = \"\n}\n\";\n}\n\n#[cfg(test)]\nmod more {}\n";
    assert_eq!(items_after_test_module(text).unwrap(), Vec::<String>::new());
    let code = product_code(text);
    assert!(
        code.contains("crate::b::g") && !code.contains("mod tests"),
        "{code}"
    );
    let bad = format!("{text}\n/// After.\npub struct Late;\n\nimpl Late {{}}\n");
    assert_eq!(
        items_after_test_module(&bad).unwrap(),
        ["struct Late", "impl"]
    );
    // A file read whole: a product item after the tests of a real file.
    let respond = std::fs::read_to_string(root().join("node/src/response/respond.rs")).unwrap();
    let (before, tests) = respond.split_at(first_test_module(&respond).unwrap());
    let moved = format!("{tests}\n{}", before.replace("//!", "//"));
    assert!(!items_after_test_module(&moved).unwrap().is_empty());
}
