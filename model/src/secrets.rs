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
//! Only high-confidence forms are kept: GitHub, GitLab, Hugging Face and
//! Slack tokens, private-key PEM blocks, AWS key pairs, long random
//! password/token assignments. Each rule has a true positive and a near
//! miss in the tests below; `testdata/secrets/` holds a corpus of real
//! job scripts that must stay silent.
//!
//! A finding never holds the secret: only its rule, its place (a line of
//! the script or a variable's name) and the first 8 hex digits of the
//! SHA-256 of the matched text ([`Finding::hash`]).

use regex::bytes::{Regex, RegexBuilder};
use sha2::{Digest, Sha256};

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
/// The digits of the SHA-256 of a secret that a finding keeps.
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
}

/// The rules, in the order findings are reported.
pub const RULES: &[Rule] = &[
    Rule {
        id: "private-key",
        kind: "a private key",
        regex: r"(?is)-----BEGIN[ A-Z0-9_-]{0,100}PRIVATE KEY(?: BLOCK)?-----.{64}.*?KEY(?: BLOCK)?-----",
        entropy: 0.0,
    },
    Rule {
        id: "aws-access-token",
        kind: "an AWS access key",
        regex: r"\b((?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16})\b",
        entropy: 3.0,
    },
    Rule {
        id: "github-pat",
        kind: "a GitHub token",
        regex: r"ghp_[0-9a-zA-Z]{36}",
        entropy: 3.0,
    },
    Rule {
        id: "github-fine-grained-pat",
        kind: "a GitHub token",
        regex: r"github_pat_\w{82}",
        entropy: 3.0,
    },
    Rule {
        id: "github-oauth",
        kind: "a GitHub token",
        regex: r"gho_[0-9a-zA-Z]{36}",
        entropy: 3.0,
    },
    Rule {
        id: "github-app-token",
        kind: "a GitHub token",
        regex: r"(?:ghu|ghs)_[0-9a-zA-Z]{36}",
        entropy: 3.0,
    },
    Rule {
        id: "github-refresh-token",
        kind: "a GitHub token",
        regex: r"ghr_[0-9a-zA-Z]{36}",
        entropy: 3.0,
    },
    Rule {
        id: "gitlab-pat",
        kind: "a GitLab token",
        regex: r"glpat-[\w-]{20}",
        entropy: 3.0,
    },
    Rule {
        id: "gitlab-ptt",
        kind: "a GitLab token",
        regex: r"glptt-[0-9a-f]{40}",
        entropy: 3.0,
    },
    Rule {
        id: "gitlab-deploy-token",
        kind: "a GitLab token",
        regex: r"gldt-[0-9a-zA-Z_\-]{20}",
        entropy: 3.0,
    },
    Rule {
        id: "huggingface-access-token",
        kind: "a Hugging Face token",
        regex: r#"(?m)\b(hf_(?i:[a-z]{34}))(?:[`'"\s;]|\\[nr]|$)"#,
        entropy: 2.0,
    },
    Rule {
        id: "huggingface-organization-api-token",
        kind: "a Hugging Face token",
        regex: r#"(?m)\b(api_org_(?i:[a-z]{34}))(?:[`'"\s;]|\\[nr]|$)"#,
        entropy: 2.0,
    },
    Rule {
        id: "slack-bot-token",
        kind: "a Slack token",
        regex: r"xoxb-[0-9]{10,13}-[0-9]{10,13}[a-zA-Z0-9-]*",
        entropy: 3.0,
    },
    Rule {
        id: "slack-user-token",
        kind: "a Slack token",
        regex: r"xox[pe](?:-[0-9]{10,13}){3}-[a-zA-Z0-9-]{28,34}",
        entropy: 2.0,
    },
    Rule {
        id: "slack-app-token",
        kind: "a Slack token",
        regex: r"(?i)xapp-\d-[A-Z0-9]+-\d+-[a-z0-9]+",
        entropy: 2.0,
    },
    Rule {
        id: "slack-webhook-url",
        kind: "a Slack webhook",
        regex: r"(?:https?://)?hooks.slack.com/(?:services|workflows|triggers)/[A-Za-z0-9+/]{43,56}",
        entropy: 0.0,
    },
    Rule {
        id: "generic-api-key",
        kind: "a password or token",
        regex: r#"(?i)\b[a-z0-9_.-]{0,40}(?:passw(?:or)?d|pwd|token|secret|api_?key|access_?key|auth_?key)["']?[ \t]*(?::=|=|:)[ \t]*["']?([a-z0-9_+/=.~-]{20,200})(?:["'`\s;,]|$)"#,
        entropy: 3.5,
    },
];

/// The AWS secret access key beside an access key id: a key naming
/// `secret` (`AWS_SECRET_ACCESS_KEY`, `aws_secret_access_key`) given 40
/// characters of base64 (gitleaks' `aws-access-token` description: the
/// secret is what makes the pair a credential).
const AWS_SECRET: &str = r#"(?i)aws[a-z0-9_.-]{0,20}secret[a-z0-9_.-]{0,20}["']?[ \t]*(?::=|=|:)[ \t]*["']?([a-z0-9/+]{40})(?:[^a-z0-9/+]|$)"#;

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
    /// The first [`HASH_HEX`] hex digits of the SHA-256 of the matched
    /// text: enough to tell two findings apart, nothing to recover it by.
    pub hash: String,
}

/// The rules, compiled once per scan.
pub struct Scanner {
    rules: Vec<(Rule, Regex)>,
    aws_secret: Regex,
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

/// The short hash a finding keeps ([`Finding::hash`]).
pub fn short_hash(secret: &[u8]) -> String {
    let d = Sha256::digest(secret);
    d.iter()
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
    /// Compiles [`RULES`].
    ///
    /// # Errors
    /// `regex::Error` if a rule does not compile (the tests compile every
    /// one, so only a build with a broken rule would).
    pub fn new() -> Result<Scanner, regex::Error> {
        let rules = RULES
            .iter()
            .map(|r| ascii(r.regex).map(|re| (*r, re)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Scanner {
            rules,
            aws_secret: ascii(AWS_SECRET)?,
        })
    }

    /// Every match of every rule in `text` (bounded by the caller), with
    /// its byte offset and the hash of its secret; AWS ids unpaired.
    fn raw(&self, text: &[u8]) -> Vec<(usize, &'static Rule, String)> {
        let mut out = Vec::new();
        for (rule, re) in &self.rules {
            for c in re.captures_iter(text) {
                let Some(whole) = c.get(0) else { continue };
                let secret = c.get(1).unwrap_or(whole);
                if rule.entropy > 0.0 && entropy(secret.as_bytes()) < rule.entropy {
                    continue;
                }
                if rule.id == "generic-api-key" && !generic_value_ok(secret.as_bytes()) {
                    continue;
                }
                let r: &'static Rule = RULES.iter().find(|x| x.id == rule.id).unwrap_or(&RULES[0]);
                out.push((secret.start(), r, short_hash(secret.as_bytes())));
            }
        }
        out
    }

    /// The AWS secret access keys in `text`: their offsets.
    fn aws_secrets(&self, text: &[u8]) -> Vec<usize> {
        self.aws_secret.find_iter(text).map(|m| m.start()).collect()
    }

    /// The findings in a batch script: at most the first
    /// [`SCRIPT_MAX_BYTES`] of `text` (any bytes: a binary script is
    /// scanned as it is, in linear time: the `regex` crate's guarantee),
    /// one per line and rule.
    pub fn scan_script(&self, text: &[u8]) -> Vec<Finding> {
        let text = &text[..text.len().min(SCRIPT_MAX_BYTES)];
        // Line numbers from one index of the newlines (a script of many
        // matches must not count from byte 0 for each: quadratic).
        let newlines: Vec<usize> = text
            .iter()
            .enumerate()
            .filter_map(|(i, &b)| (b == b'\n').then_some(i))
            .collect();
        let line_of = |off: usize| 1 + newlines.partition_point(|&p| p < off);
        let mut secrets: Vec<usize> = self.aws_secrets(text).into_iter().map(line_of).collect();
        secrets.sort_unstable();
        let near_secret = |line: usize| {
            let i = secrets.partition_point(|&s| s < line.saturating_sub(AWS_PAIR_LINES));
            secrets.get(i).is_some_and(|&s| s <= line + AWS_PAIR_LINES)
        };
        let mut seen = std::collections::HashSet::new();
        let mut out: Vec<Finding> = Vec::new();
        for (off, rule, hash) in self.raw(text) {
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
        out
    }

    /// The findings in an environment (`NAME=value` entries, any bytes):
    /// the first [`ENV_MAX_VARS`] variables and [`ENV_MAX_BYTES`], one per
    /// variable and rule. An access key id pairs with a secret anywhere in
    /// the environment.
    pub fn scan_env<'a>(&self, vars: impl IntoIterator<Item = &'a [u8]>) -> EnvScan {
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
        let paired = !self.aws_secrets(&text).is_empty();
        let mut seen = std::collections::HashSet::new();
        let mut findings: Vec<Finding> = Vec::new();
        for (off, rule, hash) in self.raw(&text) {
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
        EnvScan { findings, unread }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let s = Scanner::new().unwrap();
        let cases = cases();
        for r in RULES {
            assert!(
                cases.iter().any(|(id, _, _)| *id == r.id),
                "rule {} has no test case",
                r.id
            );
        }
        for (id, yes, no) in cases {
            let hit = s.scan_script(yes.as_bytes());
            assert!(
                hit.iter().any(|f| f.rule == id),
                "{id}: not found in {yes:?}: {hit:?}"
            );
            let miss = s.scan_script(no.as_bytes());
            assert!(miss.is_empty(), "{id}: near miss {no:?} found: {miss:?}");
        }
    }

    #[test]
    fn findings_never_hold_the_value() {
        let s = Scanner::new().unwrap();
        for (_, yes, _) in cases() {
            for f in s.scan_script(yes.as_bytes()) {
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
        let s = Scanner::new().unwrap();
        let f = s.scan_script(
            b"#!/bin/bash\n#SBATCH -N1\nexport HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestXY\n",
        );
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].place, Place::Line(3));
        assert_eq!(f[0].kind, "a Hugging Face token");
        let env = [
            &b"PATH=/usr/bin"[..],
            b"GITLAB_TOKEN=glpat-FAKEfake0123TESTtest",
            b"HOME=/home/u",
        ];
        let e = s.scan_env(env);
        assert_eq!(e.unread, 0);
        assert_eq!(e.findings.len(), 1, "{e:?}");
        assert_eq!(e.findings[0].place, Place::Var("GITLAB_TOKEN".into()));
    }

    #[test]
    fn aws_pairs_in_the_environment_anywhere_in_a_script_nearby() {
        let s = Scanner::new().unwrap();
        let id = format!("AWS_ACCESS_KEY_ID={}", aws_id());
        let secret = format!("AWS_SECRET_ACCESS_KEY={}", aws_secret());
        let e = s.scan_env([id.as_bytes(), b"X=1", secret.as_bytes()]);
        assert!(e
            .findings
            .iter()
            .any(|f| f.rule == "aws-access-token"
                && f.place == Place::Var("AWS_ACCESS_KEY_ID".into())));
        assert!(s.scan_env([id.as_bytes()]).findings.is_empty());
        let far = format!("{id}\n{}{secret}\n", "echo\n".repeat(AWS_PAIR_LINES + 1));
        assert!(s
            .scan_script(far.as_bytes())
            .iter()
            .all(|f| f.rule != "aws-access-token"));
    }

    /// A script of 10,000 token lines: the findings stop at
    /// [`MAX_FINDINGS`], the first ones by line, each with its own line
    /// number (from one newline index: no count from byte 0 per match);
    /// a single token deep in a long script has its line.
    #[test]
    fn many_matches_keep_their_lines_and_stop_at_the_bound() {
        let s = Scanner::new().unwrap();
        let text: String = (0..10_000)
            .map(|i| format!("T{i}=glpat-FAKEfake{i:04}TESTtest\n"))
            .collect();
        let f = s.scan_script(text.as_bytes());
        assert_eq!(f.len(), MAX_FINDINGS);
        let lines: Vec<Place> = f.iter().map(|x| x.place.clone()).collect();
        let want: Vec<Place> = (1..=MAX_FINDINGS).map(Place::Line).collect();
        assert_eq!(lines, want);
        let deep = format!("{}T=glpat-FAKEfake0123TESTtest\n", "echo\n".repeat(4999));
        let f = s.scan_script(deep.as_bytes());
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].place, Place::Line(5000));
    }

    /// A variable whose name holds the token (or an entry with no `=`) is
    /// named by its number, never by the name; a value's variable by name.
    #[test]
    fn a_secret_in_a_variable_name_is_never_named() {
        let s = Scanner::new().unwrap();
        let tok = "ghp_FAKEfake0123456789TESTtestFAKEfake0123";
        let places = |vars: &[String]| -> Vec<Place> {
            s.scan_env(vars.iter().map(|v| v.as_bytes()))
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
        let s = Scanner::new().unwrap();
        for end in ["/", "+"] {
            let secret = format!("{}{end}", &aws_secret()[..39]);
            let text = format!(
                "export AWS_ACCESS_KEY_ID={}\nexport AWS_SECRET_ACCESS_KEY={secret}\n",
                aws_id()
            );
            let f = s.scan_script(text.as_bytes());
            assert!(
                f.iter().any(|x| x.rule == "aws-access-token"),
                "{end}: {f:?}"
            );
        }
    }

    #[test]
    fn bounds_hold() {
        let s = Scanner::new().unwrap();
        let many: Vec<Vec<u8>> = (0..100_000)
            .map(|i| format!("V{i}=x").into_bytes())
            .collect();
        let e = s.scan_env(many.iter().map(Vec::as_slice));
        assert_eq!(e.unread, 100_000 - ENV_MAX_VARS);
        // a secret past the first MiB of a script is not read
        let mut big = vec![b'#'; SCRIPT_MAX_BYTES];
        big.extend_from_slice(b"\nT=ghp_FAKEfake0123456789TESTtestFAKEfake0123\n");
        assert!(s.scan_script(&big).is_empty());
        // binary
        let bin: Vec<u8> = (0..200_000u32).map(|i| (i * 7919 % 251) as u8).collect();
        let _ = s.scan_script(&bin);
    }

    #[test]
    fn the_false_positive_corpus_stays_silent() {
        let s = Scanner::new().unwrap();
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/secrets/clean");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let text = std::fs::read(&p).unwrap();
            let f = s.scan_script(&text);
            assert!(f.is_empty(), "{}: {f:?}", p.display());
            n += 1;
        }
        assert!(n >= 6, "the corpus is in {}", dir.display());
    }

    #[test]
    fn a_login_environment_stays_silent() {
        let s = Scanner::new().unwrap();
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/secrets/clean-env.txt");
        let text = std::fs::read(&p).unwrap();
        let vars: Vec<&[u8]> = text
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        assert!(vars.len() > 30);
        let e = s.scan_env(vars);
        assert_eq!(e, EnvScan::default(), "{}", p.display());
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_scan_without_panicking(
            text in proptest::collection::vec(proptest::num::u8::ANY, 0..4096),
            vars in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..64), 0..64),
        ) {
            static S: std::sync::OnceLock<Scanner> = std::sync::OnceLock::new();
            let s = S.get_or_init(|| Scanner::new().unwrap());
            for f in s.scan_script(&text) {
                proptest::prop_assert!(matches!(f.place, Place::Line(n) if n >= 1));
                proptest::prop_assert_eq!(f.hash.len(), HASH_HEX);
            }
            let _ = s.scan_env(vars.iter().map(Vec::as_slice));
        }
    }

    #[test]
    fn entropy_is_gitleaks() {
        assert_eq!(entropy(b""), 0.0);
        assert_eq!(entropy(b"aaaa"), 0.0);
        assert!((entropy(b"abcd") - 2.0).abs() < 1e-9);
    }
}
