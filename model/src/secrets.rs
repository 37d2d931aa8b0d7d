//! Credentials in a job's batch script and submission environment: the
//! rules and the scanner, pure (bytes in, findings out). The node layer
//! (`gpufence_node::job::door`) reads the script and the environment,
//! bounded, and says what it found.
//!
//! **The rules are gitleaks'** (`config/gitleaks.toml` of
//! github.com/gitleaks/gitleaks, master at b58d3f102c, July 2026), each
//! named by its gitleaks rule id, with gitleaks' regex and its minimum
//! Shannon entropy of the secret (`entropy`), taken as they are except:
//! - `aws-access-token` fires only with an AWS secret access key beside it
//!   (within [`AWS_PAIR_LINES`] lines of a script, or anywhere in the
//!   environment): an access key id alone is not a credential;
//! - `generic-api-key` is narrowed to assignments whose key *ends* in
//!   `password`/`passwd`/`pwd`/`token`/`secret`/`api_key`/`access_key`/
//!   `auth_key`, with a value of 20 to 200 characters holding a letter and
//!   a digit, not starting with `/`, `.`, `~` or `$` (a path or a
//!   variable), at gitleaks' entropy (3.5 bits per character);
//! - `huggingface-access-token` and `huggingface-organization-api-token`
//!   end at a line's end as well as the text's (`(?m)`), as gitleaks
//!   scans line by line.
//!
//! **Keywords first**, as gitleaks does (`detect/detect.go`,
//! `Detector.detect`: one Aho-Corasick search of the lowercased text for
//! every rule's `keywords`; a rule runs only if one of its keywords
//! occurs, a rule without keywords always): one ASCII case-insensitive
//! multi-literal search ([`aho_corasick`]) over the text, then only the
//! rules it selects are compiled (once per process) and run. A clean
//! script compiles no regex at all. Every text a rule's regex can match
//! holds one of its keywords, so the prefilter loses nothing; two lists
//! differ from gitleaks' for that reason:
//! - `slack-webhook-url`: `hooks`, not `hooks.slack.com` (gitleaks' regex
//!   leaves the dots unescaped, so `hooks-slack-com/...` matches it
//!   without holding `hooks.slack.com`);
//! - `generic-api-key`: the words the narrowed regex requires
//!   (`passwd`, `password`, `pwd`, `token`, `secret`, `key`): gitleaks'
//!   list lacks `pwd`, and its `access`, `api`, `auth`, `credential`,
//!   `creds` are either implied by `key` here or not matched at all.
//!
//! Only high-confidence forms are kept: GitHub, GitLab, Hugging Face and
//! Slack tokens, private-key PEM blocks, AWS key pairs, long random
//! password/token assignments. Each rule has a true positive and a near
//! miss in the tests below; `testdata/secrets/` holds a corpus of real
//! job scripts that must stay silent.
//!
//! A finding never holds the secret: only its rule, its place (a line of
//! the script or a variable's name) and the first 8 hex digits of the
//! HMAC-SHA256 of the matched text under the node's key ([`HashKey`],
//! [`Finding::hash`]).

use std::sync::OnceLock;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder};
use hmac::{KeyInit, Mac};
use regex::bytes::{Regex, RegexBuilder};
use sha2::Sha256;

/// The bytes of a batch script scanned: the first MiB. A longer script is
/// scanned that far (its tail unread, said in the finding line).
pub const SCRIPT_MAX_BYTES: usize = 1 << 20;
/// The variables of an environment scanned: the first 4096.
pub const ENV_MAX_VARS: usize = 4096;
/// The bytes of an environment scanned (names, `=`, values): the first
/// MiB, whole variables only.
pub const ENV_MAX_BYTES: usize = 1 << 20;
/// How far (in lines) an AWS secret access key may be from its access key
/// id in a script for `aws-access-token` to fire.
pub const AWS_PAIR_LINES: usize = 5;
/// The hex digits of a secret's keyed hash ([`HashKey`]) that a finding
/// keeps.
pub const HASH_HEX: usize = 8;

/// One rule: a gitleaks rule id, what a user is told it is, gitleaks'
/// regex (group 1, when there is one, is the secret) and minimum entropy.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    /// gitleaks' rule id (`config/gitleaks.toml`).
    pub id: &'static str,
    /// What it is, for the user's line: "a GitHub token".
    pub kind: &'static str,
    /// The regex (Rust `regex` syntax, which gitleaks' Go RE2 syntax is).
    pub regex: &'static str,
    /// gitleaks' `entropy`: the least Shannon entropy (bits per byte) of
    /// the secret; 0: none asked.
    pub entropy: f64,
    /// gitleaks' `keywords`, lowercase: the rule runs only on a text that
    /// holds one of them, compared ASCII case-insensitively (as gitleaks
    /// lowercases the text and its keywords, `detect/detect.go`,
    /// `Detector.detect`). Every text the regex matches holds one (a test
    /// checks each rule's true positive; the module's doc says where the
    /// list differs from gitleaks'). Empty: the rule always runs.
    pub keywords: &'static [&'static str],
}

/// The rules, in the order findings are reported.
pub const RULES: &[Rule] = &[
    Rule {
        id: "private-key",
        kind: "a private key",
        regex: r"(?is)-----BEGIN[ A-Z0-9_-]{0,100}PRIVATE KEY(?: BLOCK)?-----.{64}.*?KEY(?: BLOCK)?-----",
        entropy: 0.0,
        keywords: &["-----begin"],
    },
    Rule {
        id: "aws-access-token",
        kind: "an AWS access key",
        regex: r"\b((?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16})\b",
        entropy: 3.0,
        keywords: &["a3t", "akia", "asia", "abia", "acca"],
    },
    Rule {
        id: "github-pat",
        kind: "a GitHub token",
        regex: r"ghp_[0-9a-zA-Z]{36}",
        entropy: 3.0,
        keywords: &["ghp_"],
    },
    Rule {
        id: "github-fine-grained-pat",
        kind: "a GitHub token",
        regex: r"github_pat_\w{82}",
        entropy: 3.0,
        keywords: &["github_pat_"],
    },
    Rule {
        id: "github-oauth",
        kind: "a GitHub token",
        regex: r"gho_[0-9a-zA-Z]{36}",
        entropy: 3.0,
        keywords: &["gho_"],
    },
    Rule {
        id: "github-app-token",
        kind: "a GitHub token",
        regex: r"(?:ghu|ghs)_[0-9a-zA-Z]{36}",
        entropy: 3.0,
        keywords: &["ghu_", "ghs_"],
    },
    Rule {
        id: "github-refresh-token",
        kind: "a GitHub token",
        regex: r"ghr_[0-9a-zA-Z]{36}",
        entropy: 3.0,
        keywords: &["ghr_"],
    },
    Rule {
        id: "gitlab-pat",
        kind: "a GitLab token",
        regex: r"glpat-[\w-]{20}",
        entropy: 3.0,
        keywords: &["glpat-"],
    },
    Rule {
        id: "gitlab-ptt",
        kind: "a GitLab token",
        regex: r"glptt-[0-9a-f]{40}",
        entropy: 3.0,
        keywords: &["glptt-"],
    },
    Rule {
        id: "gitlab-deploy-token",
        kind: "a GitLab token",
        regex: r"gldt-[0-9a-zA-Z_\-]{20}",
        entropy: 3.0,
        keywords: &["gldt-"],
    },
    Rule {
        id: "huggingface-access-token",
        kind: "a Hugging Face token",
        regex: r#"(?m)\b(hf_(?i:[a-z]{34}))(?:[`'"\s;]|\\[nr]|$)"#,
        entropy: 2.0,
        keywords: &["hf_"],
    },
    Rule {
        id: "huggingface-organization-api-token",
        kind: "a Hugging Face token",
        regex: r#"(?m)\b(api_org_(?i:[a-z]{34}))(?:[`'"\s;]|\\[nr]|$)"#,
        entropy: 2.0,
        keywords: &["api_org_"],
    },
    Rule {
        id: "slack-bot-token",
        kind: "a Slack token",
        regex: r"xoxb-[0-9]{10,13}-[0-9]{10,13}[a-zA-Z0-9-]*",
        entropy: 3.0,
        keywords: &["xoxb"],
    },
    Rule {
        id: "slack-user-token",
        kind: "a Slack token",
        regex: r"xox[pe](?:-[0-9]{10,13}){3}-[a-zA-Z0-9-]{28,34}",
        entropy: 2.0,
        keywords: &["xoxp-", "xoxe-"],
    },
    Rule {
        id: "slack-app-token",
        kind: "a Slack token",
        regex: r"(?i)xapp-\d-[A-Z0-9]+-\d+-[a-z0-9]+",
        entropy: 2.0,
        keywords: &["xapp"],
    },
    Rule {
        id: "slack-webhook-url",
        kind: "a Slack webhook",
        regex: r"(?:https?://)?hooks.slack.com/(?:services|workflows|triggers)/[A-Za-z0-9+/]{43,56}",
        entropy: 0.0,
        keywords: &["hooks"],
    },
    Rule {
        id: "generic-api-key",
        kind: "a password or token",
        regex: r#"(?i)\b[a-z0-9_.-]{0,40}(?:passw(?:or)?d|pwd|token|secret|api_?key|access_?key|auth_?key)["']?[ \t]*(?::=|=|:)[ \t]*["']?([a-z0-9_+/=.~-]{20,200})(?:["'`\s;,]|$)"#,
        entropy: 3.5,
        keywords: &["passwd", "password", "pwd", "token", "secret", "key"],
    },
];

/// The AWS secret access key beside an access key id: a key naming
/// `secret` (`AWS_SECRET_ACCESS_KEY`, `aws_secret_access_key`) given 40
/// characters of base64 (gitleaks' `aws-access-token` description: the
/// secret is what makes the pair a credential). Compiled only when an
/// `aws-access-token` id is found. It ends at a character outside the
/// key's alphabet, not at a word boundary (a key ending in `/` or `+`
/// before a newline has none).
pub const AWS_SECRET: &str = r#"(?i)aws[a-z0-9_.-]{0,20}secret[a-z0-9_.-]{0,20}["']?[ \t]*(?::=|=|:)[ \t]*["']?([a-z0-9/+]{40})(?:[^a-z0-9/+]|$)"#;

/// The findings a scan of a script, or of an environment, keeps at most
/// (the first by line, or in the environment's order): what the job's line
/// and its audit event name stays bounded whatever the job holds.
pub const MAX_FINDINGS: usize = 64;

/// Where a finding is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    /// A line of the script, from 1.
    Line(usize),
    /// A variable of the environment, by name (printable, at most 64
    /// characters).
    Var(String),
    /// A variable of the environment by its number (from 1, in the
    /// environment's order): where the match reaches into the name or the
    /// entry has no `=`, so the name could hold the secret.
    VarAt(usize),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Line(n) => write!(f, "line {n}"),
            Place::Var(v) => write!(f, "variable {v}"),
            Place::VarAt(n) => write!(f, "variable #{n}"),
        }
    }
}

/// One credential found; never its value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The gitleaks rule id ([`Rule::id`]).
    pub rule: &'static str,
    /// What it is ([`Rule::kind`]).
    pub kind: &'static str,
    /// Where.
    pub place: Place,
    /// The first [`HASH_HEX`] hex digits of the HMAC-SHA256 of the
    /// matched text under the node's [`HashKey`]: enough to tell two
    /// findings apart (and to see one secret reused across jobs of the
    /// node), nothing to recover it by, and, without the key, nothing to
    /// confirm a guess against.
    pub hash: String,
}

/// A rule that would not compile, or a keyword list that would not
/// build (the tests build every one, so only a build with a broken rule
/// would give it).
#[derive(Clone, Debug, thiserror::Error)]
pub enum RulesError {
    /// A rule's regex (or [`AWS_SECRET`], named `aws-secret`).
    #[error("rule {0}: {1}")]
    Regex(&'static str, regex::Error),
    /// The keywords' automaton.
    #[error("keywords: {0}")]
    Keywords(String),
}

/// The keywords' automaton and, for each of its patterns, the index in
/// [`RULES`] of the rule it belongs to.
struct Prefilter {
    ac: AhoCorasick,
    rule_of: Vec<usize>,
}

static PREFILTER: OnceLock<Result<Prefilter, RulesError>> = OnceLock::new();

/// Each rule's compiled regex, index for index with [`RULES`]: compiled
/// the first time the prefilter selects the rule in this process.
static REGEXES: [OnceLock<Result<Regex, RulesError>>; RULES.len()] =
    [const { OnceLock::new() }; RULES.len()];
static AWS_SECRET_RE: OnceLock<Result<Regex, RulesError>> = OnceLock::new();

#[cfg(test)]
thread_local! {
    /// The rules this thread asked [`rule_regex`] for (tests only: the
    /// compiled regexes are shared by the tests' threads).
    static ASKED: std::cell::RefCell<Vec<&'static str>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The compiled regex of `RULES[i]`, compiling it the first time.
fn rule_regex(i: usize) -> Result<&'static Regex, RulesError> {
    #[cfg(test)]
    ASKED.with(|a| a.borrow_mut().push(RULES[i].id));
    REGEXES[i]
        .get_or_init(|| ascii(RULES[i].regex).map_err(|e| RulesError::Regex(RULES[i].id, e)))
        .as_ref()
        .map_err(Clone::clone)
}

fn aws_secret_regex() -> Result<&'static Regex, RulesError> {
    AWS_SECRET_RE
        .get_or_init(|| ascii(AWS_SECRET).map_err(|e| RulesError::Regex("aws-secret", e)))
        .as_ref()
        .map_err(Clone::clone)
}

/// The ids of the rules compiled in this process so far (for tools that
/// report what a scan cost; each is compiled at most once).
pub fn compiled_rules() -> Vec<&'static str> {
    RULES
        .iter()
        .zip(REGEXES.iter())
        .filter(|(_, re)| matches!(re.get(), Some(Ok(_))))
        .map(|(r, _)| r.id)
        .collect()
}

/// The scanner: a handle on the keywords' automaton (built once per
/// process); the rules' regexes are compiled when the keywords first
/// select them.
#[derive(Clone)]
pub struct Scanner {
    pre: &'static Prefilter,
    key: HashKey,
}

/// What [`Scanner::scan_env`] read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EnvScan {
    /// The findings, one per variable and rule.
    pub findings: Vec<Finding>,
    /// Variables left unread past [`ENV_MAX_VARS`] or [`ENV_MAX_BYTES`].
    pub unread: usize,
}

/// Shannon entropy of `b`, bits per byte (gitleaks' `shannonEntropy`,
/// `detect/utils.go`, over bytes).
pub fn entropy(b: &[u8]) -> f64 {
    if b.is_empty() {
        return 0.0;
    }
    let mut counts = [0usize; 256];
    for &c in b {
        counts[c as usize] += 1;
    }
    let n = b.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum()
}

/// The key of the hash a finding keeps: 32 bytes, the node's own (the
/// door keeps one in `state_dir`, root's, 0600). Unkeyed, 8 hex digits of
/// a SHA-256 would let anyone who reads the audit log test a guessed
/// password offline; under a key they cannot without it.
#[derive(Clone)]
pub struct HashKey([u8; 32]);

impl HashKey {
    /// The key made of `bytes`.
    pub fn from_bytes(bytes: [u8; 32]) -> HashKey {
        HashKey(bytes)
    }

    /// A new random key (`getrandom(2)`, tried again when a signal
    /// interrupts it); `None` when the kernel gives fewer bytes.
    pub fn random() -> Option<HashKey> {
        let mut b = [0u8; 32];
        for _ in 0..8 {
            // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
            let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
            if usize::try_from(n).ok() == Some(b.len()) {
                return Some(HashKey(b));
            }
            if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return None;
            }
        }
        None
    }

    /// Its bytes (to store it).
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for HashKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HashKey(..)")
    }
}

/// The short hash a finding keeps ([`Finding::hash`]): the first
/// [`HASH_HEX`] hex digits of HMAC-SHA256 (RFC 2104) of `secret` under
/// `key`.
pub fn short_hash(key: &HashKey, secret: &[u8]) -> String {
    let mut mac = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(&key.0)
        .expect("HMAC takes a key of any length");
    mac.update(secret);
    mac.finalize()
        .into_bytes()
        .iter()
        .take(HASH_HEX / 2)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether a `generic-api-key` value looks like a secret and not a path,
/// a variable, a word or a number.
fn generic_value_ok(v: &[u8]) -> bool {
    !matches!(v.first(), Some(b'/' | b'.' | b'~' | b'$'))
        && v.iter().any(u8::is_ascii_alphabetic)
        && v.iter().any(u8::is_ascii_digit)
}

/// `re` over bytes with Unicode off: `\w`, `\b`, `(?i)` and `.` are
/// ASCII (and `.` any byte), as every rule's alphabet is; a script's
/// invalid UTF-8 is matched like any byte, and the automata stay small
/// (compiling them is most of a scan's cost: BENCHMARKS.md, section 8).
fn ascii(re: &str) -> Result<Regex, regex::Error> {
    RegexBuilder::new(re).unicode(false).build()
}

/// `findings` without a `generic-api-key` finding where a specific rule
/// found something at the same place (`HF_TOKEN=hf_...` is one Hugging
/// Face token, not also a token assignment).
fn without_generic_twins(findings: Vec<Finding>) -> Vec<Finding> {
    let specific: std::collections::HashSet<Place> = findings
        .iter()
        .filter(|f| f.rule != "generic-api-key")
        .map(|f| f.place.clone())
        .collect();
    findings
        .into_iter()
        .filter(|f| f.rule != "generic-api-key" || !specific.contains(&f.place))
        .collect()
}

impl Scanner {
    /// The scanner, its findings' hashes keyed with `key`, building the
    /// keywords' automaton the first time in this process (microseconds;
    /// no regex is compiled here).
    ///
    /// # Errors
    /// [`RulesError::Keywords`] if the automaton does not build.
    pub fn new(key: HashKey) -> Result<Scanner, RulesError> {
        let pre = PREFILTER.get_or_init(|| {
            let mut pats = Vec::new();
            let mut rule_of = Vec::new();
            for (i, r) in RULES.iter().enumerate() {
                for k in r.keywords {
                    pats.push(*k);
                    rule_of.push(i);
                }
            }
            AhoCorasickBuilder::new()
                .ascii_case_insensitive(true)
                .build(&pats)
                .map(|ac| Prefilter { ac, rule_of })
                .map_err(|e| RulesError::Keywords(e.to_string()))
        });
        match pre {
            Ok(pre) => Ok(Scanner { pre, key }),
            Err(e) => Err(e.clone()),
        }
    }

    /// Whether each rule (index for index with [`RULES`]) is to run on
    /// `text`: one of its keywords occurs in it (ASCII case-insensitive,
    /// overlapping occurrences included), or it has none.
    pub fn selected(&self, text: &[u8]) -> [bool; RULES.len()] {
        let mut sel = [false; RULES.len()];
        for (s, r) in sel.iter_mut().zip(RULES) {
            *s = r.keywords.is_empty();
        }
        let mut left = sel.iter().filter(|s| !**s).count();
        for m in self.pre.ac.find_overlapping_iter(text) {
            let i = self.pre.rule_of[m.pattern().as_usize()];
            if !sel[i] {
                sel[i] = true;
                left -= 1;
                if left == 0 {
                    break;
                }
            }
        }
        sel
    }

    /// Every match of every selected rule in `text` (bounded by the
    /// caller), with its byte offset and the hash of its secret; AWS ids
    /// unpaired.
    fn raw(&self, text: &[u8]) -> Result<Vec<(usize, &'static Rule, String)>, RulesError> {
        let mut out = Vec::new();
        let sel = self.selected(text);
        for (i, rule) in RULES.iter().enumerate() {
            if !sel[i] {
                continue;
            }
            let re = rule_regex(i)?;
            for c in re.captures_iter(text) {
                let Some(whole) = c.get(0) else { continue };
                let secret = c.get(1).unwrap_or(whole);
                if rule.entropy > 0.0 && entropy(secret.as_bytes()) < rule.entropy {
                    continue;
                }
                if rule.id == "generic-api-key" && !generic_value_ok(secret.as_bytes()) {
                    continue;
                }
                out.push((
                    secret.start(),
                    rule,
                    short_hash(&self.key, secret.as_bytes()),
                ));
            }
        }
        Ok(out)
    }

    /// The AWS secret access keys in `text`: their offsets; none looked
    /// for (nor [`AWS_SECRET`] compiled) unless `raw` holds an AWS id.
    fn aws_secrets(
        &self,
        text: &[u8],
        raw: &[(usize, &'static Rule, String)],
    ) -> Result<Vec<usize>, RulesError> {
        if !raw.iter().any(|(_, r, _)| r.id == "aws-access-token") {
            return Ok(Vec::new());
        }
        Ok(aws_secret_regex()?
            .find_iter(text)
            .map(|m| m.start())
            .collect())
    }

    /// The findings in a batch script: at most the first
    /// [`SCRIPT_MAX_BYTES`] of `text` (any bytes: a binary script is
    /// scanned as it is, in linear time: the `regex` crate's guarantee),
    /// one per line and rule.
    ///
    /// # Errors
    /// [`RulesError`] if a rule the keywords selected does not compile.
    pub fn scan_script(&self, text: &[u8]) -> Result<Vec<Finding>, RulesError> {
        let text = &text[..text.len().min(SCRIPT_MAX_BYTES)];
        // Line numbers from one index of the newlines (a script of many
        // matches must not count from byte 0 for each: quadratic).
        let newlines: Vec<usize> = text
            .iter()
            .enumerate()
            .filter_map(|(i, &b)| (b == b'\n').then_some(i))
            .collect();
        let line_of = |off: usize| 1 + newlines.partition_point(|&p| p < off);
        let raw = self.raw(text)?;
        let mut secrets: Vec<usize> = self
            .aws_secrets(text, &raw)?
            .into_iter()
            .map(line_of)
            .collect();
        secrets.sort_unstable();
        let near_secret = |line: usize| {
            let i = secrets.partition_point(|&s| s < line.saturating_sub(AWS_PAIR_LINES));
            secrets.get(i).is_some_and(|&s| s <= line + AWS_PAIR_LINES)
        };
        let mut seen = std::collections::HashSet::new();
        let mut out: Vec<Finding> = Vec::new();
        for (off, rule, hash) in raw {
            let line = line_of(off);
            if rule.id == "aws-access-token" && !near_secret(line) {
                continue;
            }
            if seen.insert((rule.id, line)) {
                out.push(Finding {
                    rule: rule.id,
                    kind: rule.kind,
                    place: Place::Line(line),
                    hash,
                });
            }
        }
        let mut out = without_generic_twins(out);
        out.sort_by_key(|f| match f.place {
            Place::Line(n) => n,
            Place::Var(_) | Place::VarAt(_) => 0,
        });
        out.truncate(MAX_FINDINGS);
        Ok(out)
    }

    /// The findings in an environment (`NAME=value` entries, any bytes):
    /// the first [`ENV_MAX_VARS`] variables and [`ENV_MAX_BYTES`], one per
    /// variable and rule. An access key id pairs with a secret anywhere in
    /// the environment.
    ///
    /// # Errors
    /// [`RulesError`] if a rule the keywords selected does not compile.
    pub fn scan_env<'a>(
        &self,
        vars: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<EnvScan, RulesError> {
        let mut text = Vec::new();
        let mut starts: Vec<(usize, &'a [u8])> = Vec::new();
        let mut unread = 0;
        for v in vars {
            if starts.len() >= ENV_MAX_VARS || text.len() + v.len() + 1 > ENV_MAX_BYTES {
                unread += 1;
                continue;
            }
            starts.push((text.len(), v));
            text.extend_from_slice(v);
            text.push(b'\n');
        }
        // The variable's name, unless the match reaches into it or the
        // entry has no `=` (the secret could be the name itself): then
        // its number ([`Place::VarAt`]).
        let var_of = |off: usize| {
            let i = starts.partition_point(|(s, _)| *s <= off).saturating_sub(1);
            let (start, entry) = starts.get(i).copied().unwrap_or((0, &b""[..]));
            match entry.iter().position(|&b| b == b'=') {
                Some(eq) if off >= start + eq => Place::Var(
                    crate::text::printable(&String::from_utf8_lossy(&entry[..eq]))
                        .chars()
                        .take(64)
                        .collect(),
                ),
                _ => Place::VarAt(i + 1),
            }
        };
        let raw = self.raw(&text)?;
        let paired = !self.aws_secrets(&text, &raw)?.is_empty();
        let mut seen = std::collections::HashSet::new();
        let mut findings: Vec<Finding> = Vec::new();
        for (off, rule, hash) in raw {
            if rule.id == "aws-access-token" && !paired {
                continue;
            }
            let f = Finding {
                rule: rule.id,
                kind: rule.kind,
                place: var_of(off),
                hash,
            };
            if seen.insert((f.rule, f.place.clone())) {
                findings.push(f);
            }
        }
        let mut findings = without_generic_twins(findings);
        findings.truncate(MAX_FINDINGS);
        Ok(EnvScan { findings, unread })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key the tests hash under.
    pub(super) fn key() -> HashKey {
        HashKey::from_bytes([7; 32])
    }

    /// HMAC-SHA256, RFC 4231 test case 2 ("Jefe"; padded with zeros to 32
    /// bytes, which HMAC does to a short key itself): the digits are the
    /// standard's, so the hash is HMAC and not a home-grown mix.
    #[test]
    fn the_hash_is_hmac_sha256_under_the_key() {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(b"Jefe");
        let h = short_hash(&HashKey::from_bytes(k), b"what do ya want for nothing?");
        assert_eq!(h, "5bdcc146");
        assert_ne!(
            short_hash(&HashKey::from_bytes([1; 32]), b"hunter2hunter2"),
            short_hash(&HashKey::from_bytes([2; 32]), b"hunter2hunter2"),
            "another node's key, another hash"
        );
        assert_eq!(
            format!("{:?}", key()),
            "HashKey(..)",
            "the key is never printed"
        );
    }

    /// Synthetic values of each rule's shape: obviously fake.
    fn aws_id() -> String {
        "AKIAFAKE2345TESTFAKE".into()
    }
    fn aws_secret() -> String {
        "fakeFAKEfake0123456789/+TESTtestTESTtest".into()
    }

    /// (rule id, a true positive, a near miss) for every rule.
    fn cases() -> Vec<(&'static str, String, String)> {
        let pem_body =
            "FAKEFAKEfakefake0123456789TESTtestTESTtest0123456789FAKEFAKEfakefake\n".repeat(3);
        vec![
            (
                "private-key",
                format!("cat > k <<EOF\n-----BEGIN OPENSSH PRIVATE KEY-----\n{pem_body}-----END OPENSSH PRIVATE KEY-----\nEOF\n"),
                format!("cat > k <<EOF\n-----BEGIN PUBLIC KEY-----\n{pem_body}-----END PUBLIC KEY-----\nEOF\n"),
            ),
            (
                "aws-access-token",
                format!("export AWS_ACCESS_KEY_ID={}\nexport AWS_SECRET_ACCESS_KEY={}\n", aws_id(), aws_secret()),
                // an id alone is not a credential
                format!("export AWS_ACCESS_KEY_ID={}\naws s3 ls\n", aws_id()),
            ),
            (
                "github-pat",
                "git clone https://ghp_FAKEfake0123456789TESTtestFAKEfake0123@github.com/x/y\n".into(),
                // 35 characters of the 36
                "git clone https://ghp_FAKEfake0123456789TESTtestFAKEfake0@github.com/x/y\n".into(),
            ),
            (
                "github-fine-grained-pat",
                format!("GH=github_pat_{}\n", "FAKEfake0123456789TESTtest_".repeat(3) + "FAKE"),
                "GH=github_pat_FAKEfake0123\n".into(),
            ),
            (
                "github-oauth",
                "T=gho_FAKEfake0123456789TESTtestFAKEfake0123\n".into(),
                // 35 characters of the 36
                "T=gho_FAKEfake0123456789TESTtestFAKEfake0\n".into(),
            ),
            (
                "github-app-token",
                "T=ghs_FAKEfake0123456789TESTtestFAKEfake0123\n".into(),
                "T=ghx_FAKEfake0123456789TESTtestFAKEfake0123\n".into(),
            ),
            (
                "github-refresh-token",
                "T=ghr_FAKEfake0123456789TESTtestFAKEfake0123\n".into(),
                "T=ghr_FAKEfake01234567\n".into(),
            ),
            (
                "gitlab-pat",
                "git clone https://oauth2:glpat-FAKEfake0123TESTtest@gitlab.example/x\n".into(),
                // 19 characters of the 20
                "git clone https://oauth2:glpat-FAKEfake0123TESTtes@gitlab.example/x\n".into(),
            ),
            (
                "gitlab-ptt",
                format!("T=glptt-{}\n", "0123456789abcdef0123456789abcdef01234567"),
                "T=glptt-0123456789abcdefXYZ\n".into(),
            ),
            (
                "gitlab-deploy-token",
                "T=gldt-FAKEfake0123TESTtest\n".into(),
                // 19 characters of the 20
                "T=gldt-FAKEfake0123TESTtes\n".into(),
            ),
            (
                "huggingface-access-token",
                "export HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestXY\n".into(),
                // 33 letters
                "export HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestX\n".into(),
            ),
            (
                "huggingface-organization-api-token",
                "T=api_org_FAKEfakeFAKEfakeTESTtestTESTtestXY\n".into(),
                "T=api_org_FAKEfake\n".into(),
            ),
            (
                "slack-bot-token",
                "curl -H 'Authorization: Bearer xoxb-1234567890-1234567890-FAKEfakeTESTtest'\n".into(),
                "curl -H 'Authorization: Bearer xoxb-12345-FAKE'\n".into(),
            ),
            (
                "slack-user-token",
                "T=xoxp-1234567890-1234567890-1234567890-FAKEfake0123456789TESTtestFAKE\n".into(),
                "T=xoxp-1234567890-FAKEfake\n".into(),
            ),
            (
                "slack-app-token",
                "T=xapp-1-AFAKE0123-1234567890-fake0123456789abcdef\n".into(),
                "T=xapp-FAKE\n".into(),
            ),
            (
                "slack-webhook-url",
                "curl -X POST https://hooks.slack.com/services/TFAKE0000/BFAKE0000/FAKEfake0123456789TESTtest01\n".into(),
                "curl -X POST https://hooks.slack.com/services/TFAKE\n".into(),
            ),
            (
                "generic-api-key",
                "export WANDB_API_KEY=fake0123FAKE4567test89TEST\n".into(),
                "export WANDB_API_KEY=$(cat ~/.wandb_key)\n".into(),
            ),
        ]
    }

    #[test]
    fn every_rule_compiles_and_has_a_positive_and_a_near_miss() {
        let s = Scanner::new(key()).unwrap();
        let cases = cases();
        for r in RULES {
            assert!(
                cases.iter().any(|(id, _, _)| *id == r.id),
                "rule {} has no test case",
                r.id
            );
        }
        for (id, yes, no) in cases {
            let hit = s.scan_script(yes.as_bytes()).unwrap();
            assert!(
                hit.iter().any(|f| f.rule == id),
                "{id}: not found in {yes:?}: {hit:?}"
            );
            let miss = s.scan_script(no.as_bytes()).unwrap();
            assert!(miss.is_empty(), "{id}: near miss {no:?} found: {miss:?}");
        }
    }

    /// The keywords of the rule `id` that `text` holds (ASCII
    /// case-insensitive), by plain search: the prefilter's reference.
    fn keywords_in(id: &str, text: &[u8]) -> Vec<&'static str> {
        let r = RULES.iter().find(|r| r.id == id).unwrap();
        let low = text.to_ascii_lowercase();
        r.keywords
            .iter()
            .copied()
            .filter(|k| low.windows(k.len()).any(|w| w == k.as_bytes()))
            .collect()
    }

    #[test]
    fn the_keywords_select_every_true_positive() {
        let s = Scanner::new(key()).unwrap();
        for (id, yes, _) in cases() {
            let i = RULES.iter().position(|r| r.id == id).unwrap();
            assert!(
                s.selected(yes.as_bytes())[i],
                "{id}: not selected in {yes:?}"
            );
            // every match of the regex holds a keyword itself, not only
            // the text around it
            let re = rule_regex(i).unwrap();
            let mut n = 0;
            for m in re.find_iter(yes.as_bytes()) {
                assert!(
                    !keywords_in(id, m.as_bytes()).is_empty(),
                    "{id}: match {:?} holds none of {:?}",
                    String::from_utf8_lossy(m.as_bytes()),
                    RULES[i].keywords
                );
                n += 1;
            }
            assert!(n > 0, "{id}");
            // in any case, and as an environment variable
            for text in [yes.to_ascii_uppercase(), yes.to_ascii_lowercase()] {
                assert!(s.selected(text.as_bytes())[i], "{id}: {text:?}");
            }
            let var = yes
                .lines()
                .map(|l| l.trim_start_matches("export "))
                .collect::<Vec<_>>();
            let e = s.scan_env(var.iter().map(|v| v.as_bytes())).unwrap();
            assert!(
                e.findings.iter().any(|f| f.rule == id) || id == "private-key",
                "{id}: not found in the environment {var:?}: {e:?}"
            );
        }
        // the prefilter agrees with a plain search on every case, both ways
        for (_, yes, no) in cases() {
            for text in [yes, no] {
                let sel = s.selected(text.as_bytes());
                for (i, r) in RULES.iter().enumerate() {
                    assert_eq!(
                        sel[i],
                        r.keywords.is_empty() || !keywords_in(r.id, text.as_bytes()).is_empty(),
                        "{}: {text:?}",
                        r.id
                    );
                }
            }
        }
    }

    /// Where the keywords differ from gitleaks' (the module's doc): texts
    /// the regex matches without holding gitleaks' keywords are found.
    #[test]
    fn the_keywords_gitleaks_would_miss() {
        let s = Scanner::new(key()).unwrap();
        // gitleaks' keyword is `hooks.slack.com`; its regex's dots match
        // any byte
        let hook = "curl -X POST https://hooks-slack-com/services/TFAKE0000/BFAKE0000/FAKEfake0123456789TESTtest01\n";
        assert!(s
            .scan_script(hook.as_bytes())
            .unwrap()
            .iter()
            .any(|f| f.rule == "slack-webhook-url"));
        // gitleaks' list has no `pwd`
        let pwd = "export DB_PWD=fake0123FAKE4567test89TEST\n";
        assert!(s
            .scan_script(pwd.as_bytes())
            .unwrap()
            .iter()
            .any(|f| f.rule == "generic-api-key"));
    }

    /// The rules this thread asked for while `f` ran.
    fn asked_during(f: impl FnOnce()) -> Vec<&'static str> {
        ASKED.with(|a| a.borrow_mut().clear());
        f();
        ASKED.with(|a| a.borrow().clone())
    }

    #[test]
    fn a_clean_script_compiles_no_regex() {
        let s = Scanner::new(key()).unwrap();
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/secrets/clean");
        // scripts of the corpus without a keyword in them
        for name in ["mpi-gromacs.sh", "digests-uuids.sh"] {
            let text = std::fs::read(dir.join(name)).unwrap();
            let env: Vec<&[u8]> = vec![b"PATH=/usr/bin:/bin", b"HOME=/home/u", b"SLURM_JOB_ID=1"];
            assert_eq!(
                asked_during(|| {
                    assert!(s.scan_script(&text).unwrap().is_empty());
                    assert!(s.scan_env(env).unwrap().findings.is_empty());
                }),
                Vec::<&str>::new(),
                "{name}"
            );
        }
        // a script naming HF_TOKEN_PATH and WANDB_API_KEY_FILE compiles
        // those two rules, and finds nothing
        let text = std::fs::read(dir.join("torchrun-ddp.sh")).unwrap();
        let asked = asked_during(|| assert!(s.scan_script(&text).unwrap().is_empty()));
        assert_eq!(asked, ["huggingface-access-token", "generic-api-key"]);
        // and a token compiles its rule (and only the rules its words select)
        let asked = asked_during(|| {
            let f = s
                .scan_script(b"export HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestXY\n")
                .unwrap();
            assert_eq!(f.len(), 1);
        });
        assert_eq!(asked, ["huggingface-access-token", "generic-api-key"]);
        assert!(compiled_rules().contains(&"huggingface-access-token"));
    }

    #[test]
    fn findings_never_hold_the_value() {
        let s = Scanner::new(key()).unwrap();
        for (_, yes, _) in cases() {
            for f in s.scan_script(yes.as_bytes()).unwrap() {
                let shown = format!("{f:?} {}", f.place);
                for word in yes.split(|c: char| !c.is_ascii_alphanumeric() && c != '_' && c != '-')
                {
                    if word.len() >= 16 {
                        assert!(!shown.contains(word), "{shown} holds {word}");
                    }
                }
                assert_eq!(f.hash.len(), HASH_HEX);
            }
        }
    }

    #[test]
    fn line_numbers_and_variables() {
        let s = Scanner::new(key()).unwrap();
        let f = s.scan_script(
            b"#!/bin/bash\n#SBATCH -N1\nexport HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestXY\n",
        ).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].place, Place::Line(3));
        assert_eq!(f[0].kind, "a Hugging Face token");
        let env = [
            &b"PATH=/usr/bin"[..],
            b"GITLAB_TOKEN=glpat-FAKEfake0123TESTtest",
            b"HOME=/home/u",
        ];
        let e = s.scan_env(env).unwrap();
        assert_eq!(e.unread, 0);
        assert_eq!(e.findings.len(), 1, "{e:?}");
        assert_eq!(e.findings[0].place, Place::Var("GITLAB_TOKEN".into()));
    }

    #[test]
    fn aws_pairs_in_the_environment_anywhere_in_a_script_nearby() {
        let s = Scanner::new(key()).unwrap();
        let id = format!("AWS_ACCESS_KEY_ID={}", aws_id());
        let secret = format!("AWS_SECRET_ACCESS_KEY={}", aws_secret());
        let e = s
            .scan_env([id.as_bytes(), b"X=1", secret.as_bytes()])
            .unwrap();
        assert!(e
            .findings
            .iter()
            .any(|f| f.rule == "aws-access-token"
                && f.place == Place::Var("AWS_ACCESS_KEY_ID".into())));
        assert!(s.scan_env([id.as_bytes()]).unwrap().findings.is_empty());
        let far = format!("{id}\n{}{secret}\n", "echo\n".repeat(AWS_PAIR_LINES + 1));
        assert!(s
            .scan_script(far.as_bytes())
            .unwrap()
            .iter()
            .all(|f| f.rule != "aws-access-token"));
    }

    /// A script of 10,000 token lines: the findings stop at
    /// [`MAX_FINDINGS`], the first ones by line, each with its own line
    /// number (from one newline index: no count from byte 0 per match);
    /// a single token deep in a long script has its line.
    #[test]
    fn many_matches_keep_their_lines_and_stop_at_the_bound() {
        let s = Scanner::new(key()).unwrap();
        let text: String = (0..10_000)
            .map(|i| format!("T{i}=glpat-FAKEfake{i:04}TESTtest\n"))
            .collect();
        let f = s.scan_script(text.as_bytes()).unwrap();
        assert_eq!(f.len(), MAX_FINDINGS);
        let lines: Vec<Place> = f.iter().map(|x| x.place.clone()).collect();
        let want: Vec<Place> = (1..=MAX_FINDINGS).map(Place::Line).collect();
        assert_eq!(lines, want);
        let deep = format!("{}T=glpat-FAKEfake0123TESTtest\n", "echo\n".repeat(4999));
        let f = s.scan_script(deep.as_bytes()).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].place, Place::Line(5000));
    }

    /// A variable whose name holds the token (or an entry with no `=`) is
    /// named by its number, never by the name; a value's variable by name.
    #[test]
    fn a_secret_in_a_variable_name_is_never_named() {
        let s = Scanner::new(key()).unwrap();
        let tok = "ghp_FAKEfake0123456789TESTtestFAKEfake0123";
        let places = |vars: &[String]| -> Vec<Place> {
            s.scan_env(vars.iter().map(|v| v.as_bytes()))
                .unwrap()
                .findings
                .into_iter()
                .map(|f| f.place)
                .collect()
        };
        assert_eq!(places(&[format!("{tok}=1")]), vec![Place::VarAt(1)]);
        assert_eq!(
            places(&["HOME=/home/a".into(), tok.to_string()]),
            vec![Place::VarAt(2)]
        );
        assert_eq!(places(&[format!("T={tok}")]), vec![Place::Var("T".into())]);
        for p in places(&[format!("{tok}=1"), tok.to_string()]) {
            assert!(!p.to_string().contains("FAKEfake"), "{p}");
        }
    }

    /// An AWS secret ending in `/` or `+` pairs with its access key id
    /// (the pattern ends at a character outside the key's alphabet, not at
    /// a word boundary, which `/` then a newline is not).
    #[test]
    fn aws_secrets_ending_in_slash_or_plus_pair() {
        let s = Scanner::new(key()).unwrap();
        for end in ["/", "+"] {
            let secret = format!("{}{end}", &aws_secret()[..39]);
            let text = format!(
                "export AWS_ACCESS_KEY_ID={}\nexport AWS_SECRET_ACCESS_KEY={secret}\n",
                aws_id()
            );
            let f = s.scan_script(text.as_bytes()).unwrap();
            assert!(
                f.iter().any(|x| x.rule == "aws-access-token"),
                "{end}: {f:?}"
            );
        }
    }

    #[test]
    fn bounds_hold() {
        let s = Scanner::new(key()).unwrap();
        let many: Vec<Vec<u8>> = (0..100_000)
            .map(|i| format!("V{i}=x").into_bytes())
            .collect();
        let e = s.scan_env(many.iter().map(Vec::as_slice)).unwrap();
        assert_eq!(e.unread, 100_000 - ENV_MAX_VARS);
        // a secret past the first MiB of a script is not read
        let mut big = vec![b'#'; SCRIPT_MAX_BYTES];
        big.extend_from_slice(b"\nT=ghp_FAKEfake0123456789TESTtestFAKEfake0123\n");
        assert!(s.scan_script(&big).unwrap().is_empty());
        // binary
        let bin: Vec<u8> = (0..200_000u32).map(|i| (i * 7919 % 251) as u8).collect();
        s.scan_script(&bin).unwrap();
    }

    #[test]
    fn the_false_positive_corpus_stays_silent() {
        let s = Scanner::new(key()).unwrap();
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/secrets/clean");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let text = std::fs::read(&p).unwrap();
            let f = s.scan_script(&text).unwrap();
            assert!(f.is_empty(), "{}: {f:?}", p.display());
            n += 1;
        }
        assert!(n >= 6, "the corpus is in {}", dir.display());
    }

    #[test]
    fn a_login_environment_stays_silent() {
        let s = Scanner::new(key()).unwrap();
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/secrets/clean-env.txt");
        let text = std::fs::read(&p).unwrap();
        let vars: Vec<&[u8]> = text
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        assert!(vars.len() > 30);
        let e = s.scan_env(vars).unwrap();
        assert_eq!(e, EnvScan::default(), "{}", p.display());
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_scan_without_panicking(
            text in proptest::collection::vec(proptest::num::u8::ANY, 0..4096),
            vars in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..64), 0..64),
        ) {
            let s = Scanner::new(key()).unwrap();
            for f in s.scan_script(&text).unwrap() {
                proptest::prop_assert!(matches!(f.place, Place::Line(n) if n >= 1));
                proptest::prop_assert_eq!(f.hash.len(), HASH_HEX);
            }
            s.scan_env(vars.iter().map(Vec::as_slice)).unwrap();
        }
    }

    #[test]
    fn entropy_is_gitleaks() {
        assert_eq!(entropy(b""), 0.0);
        assert_eq!(entropy(b"aaaa"), 0.0);
        assert!((entropy(b"abcd") - 2.0).abs() < 1e-9);
    }
}
