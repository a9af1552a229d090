//! Label selectors in Kubernetes' string syntax, so one value can be matched by the embedded
//! store and passed verbatim to the API server as `labelSelector=`.
//!
//! ```text
//! selector    = requirement ("," requirement)*        all must hold
//! requirement = key "=" value | key "==" value | key "!=" value
//!             | key "in" "(" values ")" | key "notin" "(" values ")"
//!             | key | "!" key                          exists / does not exist
//! ```
//!
//! `!=` and `notin` hold for an object without the key, as in Kubernetes. Keys are an
//! optional DNS-subdomain prefix and `/`, then a name of at most 63 of `A-Za-z0-9-_.`; values
//! are at most 63 of the same, alphanumeric at both ends (or empty).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid label selector {selector:?}: {reason}")]
pub struct SelectorError {
    pub selector: String,
    pub reason: String,
}

fn name_ok(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.'))
        && s.starts_with(alnum)
        && s.ends_with(alnum)
}

fn key_ok(key: &str) -> bool {
    match key.split_once('/') {
        Some((prefix, name)) => crate::meta::validate_object_name(prefix).is_ok() && name_ok(name),
        None => name_ok(key),
    }
}

fn value_ok(v: &str) -> bool {
    v.is_empty() || name_ok(v)
}

impl LabelSelector {
    /// Matches everything.
    pub fn everything() -> Self {
        LabelSelector::default()
    }

    /// `key=value`, adding to what is already required.
    pub fn equals(mut self, key: &str, value: &str) -> Self {
        self.requirements
            .push(Requirement::Equals(key.to_string(), value.to_string()));
        self
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::NotEquals(k, v) => labels.get(k) != Some(v),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::NotExists(k) => !labels.contains_key(k),
        })
    }

    /// Whether a stored JSON object's `metadata.labels` match.
    pub fn matches_object(&self, object: &serde_json::Value) -> bool {
        if self.is_empty() {
            return true;
        }
        let labels: BTreeMap<String, String> = object
            .pointer("/metadata/labels")
            .and_then(serde_json::Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        self.matches(&labels)
    }
}

/// Split on commas that are not inside parentheses.
fn split_requirements(s: &str) -> Option<Vec<&str>> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return None;
        }
    }
    if depth != 0 {
        return None;
    }
    out.push(&s[start..]);
    Some(out)
}

impl FromStr for LabelSelector {
    type Err = SelectorError;

    fn from_str(s: &str) -> Result<Self, SelectorError> {
        let fail = |reason: String| SelectorError {
            selector: s.to_string(),
            reason,
        };
        let mut requirements = Vec::new();
        if s.trim().is_empty() {
            return Ok(LabelSelector { requirements });
        }
        let parts = split_requirements(s).ok_or_else(|| fail("unbalanced parentheses".into()))?;
        for part in parts {
            let part = part.trim();
            let check_key = |k: &str| {
                if key_ok(k) {
                    Ok(k.to_string())
                } else {
                    Err(fail(format!("{k:?} is not a valid label key")))
                }
            };
            let check_value = |v: &str| {
                if value_ok(v) {
                    Ok(v.to_string())
                } else {
                    Err(fail(format!("{v:?} is not a valid label value")))
                }
            };
            let set_of = |rest: &str| -> Result<BTreeSet<String>, SelectorError> {
                let inner = rest
                    .trim()
                    .strip_prefix('(')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| fail(format!("{part:?}: expected a list in parentheses")))?;
                inner.split(',').map(|v| check_value(v.trim())).collect()
            };
            let req = if let Some(k) = part.strip_prefix('!') {
                Requirement::NotExists(check_key(k.trim())?)
            } else if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(check_key(k.trim())?, check_value(v.trim())?)
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Equals(check_key(k.trim())?, check_value(v.trim())?)
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Equals(check_key(k.trim())?, check_value(v.trim())?)
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                Requirement::NotIn(check_key(k.trim())?, set_of(rest)?)
            } else if let Some((k, rest)) = part.split_once(" in ") {
                Requirement::In(check_key(k.trim())?, set_of(rest)?)
            } else if part.is_empty() {
                return Err(fail("empty requirement".into()));
            } else {
                Requirement::Exists(check_key(part)?)
            };
            requirements.push(req);
        }
        Ok(LabelSelector { requirements })
    }
}

impl fmt::Display for LabelSelector {
    /// The Kubernetes string form, which parses back to the same selector.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = |vs: &BTreeSet<String>| vs.iter().cloned().collect::<Vec<_>>().join(",");
        let parts: Vec<String> = self
            .requirements
            .iter()
            .map(|r| match r {
                Requirement::Equals(k, v) => format!("{k}={v}"),
                Requirement::NotEquals(k, v) => format!("{k}!={v}"),
                Requirement::In(k, vs) => format!("{k} in ({})", set(vs)),
                Requirement::NotIn(k, vs) => format!("{k} notin ({})", set(vs)),
                Requirement::Exists(k) => k.clone(),
                Requirement::NotExists(k) => format!("!{k}"),
            })
            .collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn sel(s: &str) -> LabelSelector {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn every_operator_matches_as_in_kubernetes() {
        let db = labels(&[("zebu.io/volume", "db"), ("tier", "gold")]);
        let bare = labels(&[]);
        let cases: &[(&str, bool, bool)] = &[
            // (selector, matches db, matches an object without labels)
            ("", true, true),
            ("zebu.io/volume=db", true, false),
            ("zebu.io/volume==db", true, false),
            ("zebu.io/volume=web", false, false),
            ("zebu.io/volume!=web", true, true),
            ("tier in (gold, silver)", true, false),
            ("tier notin (gold)", false, true),
            ("tier", true, false),
            ("!tier", false, true),
            ("zebu.io/volume=db,tier=gold", true, false),
            ("zebu.io/volume=db,tier=silver", false, false),
            ("tier in (silver),zebu.io/volume=db", false, false),
        ];
        for (s, on_db, on_bare) in cases {
            let parsed = sel(s);
            assert_eq!(parsed.matches(&db), *on_db, "{s} on db");
            assert_eq!(parsed.matches(&bare), *on_bare, "{s} on no labels");
            // The string form parses back to the same selector.
            assert_eq!(sel(&parsed.to_string()), parsed, "{s}");
        }
        assert_eq!(
            LabelSelector::everything()
                .equals("zebu.io/volume", "db")
                .to_string(),
            "zebu.io/volume=db"
        );
    }

    #[test]
    fn bad_selectors_are_refused_with_the_reason() {
        for bad in [
            "a=b=c",
            "tier in gold",
            "tier in (gold",
            "Bad Key=x",
            "k=-x",
            ",",
            "a=b,",
            "x/y/z=1",
            &format!("k={}", "v".repeat(64)),
        ] {
            let e = bad.parse::<LabelSelector>().expect_err(bad);
            assert!(e.to_string().contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }

    #[test]
    fn objects_are_matched_by_their_metadata_labels() {
        let obj =
            serde_json::json!({"metadata": {"name": "r", "labels": {"zebu.io/volume": "db"}}});
        assert!(sel("zebu.io/volume=db").matches_object(&obj));
        assert!(!sel("zebu.io/volume=web").matches_object(&obj));
        assert!(sel("!zebu.io/node").matches_object(&obj));
        assert!(!sel("zebu.io/volume").matches_object(&serde_json::json!({"metadata": {}})));
    }
}
