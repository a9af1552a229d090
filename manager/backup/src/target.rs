//! Opening a backup target from a [`TargetRef`]: its URL, plus credentials from a file of
//! `AWS_*=value` lines (what the manager makes of a target's credential Secret) or, without
//! one, from the standard AWS variables of this process.

use std::path::Path;

use zebu_backupstore::{BackupStore, S3Settings, StoreOptions, TargetConfig};

use crate::job::TargetRef;

/// Why a credentials file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("credentials file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("credentials file {path}, line {line}: expected NAME=VALUE with an AWS_ name")]
    Syntax { path: String, line: usize },
    #[error("credential Secret {secret}: key {key:?} {why}")]
    Key {
        secret: String,
        key: String,
        why: &'static str,
    },
}

/// Sets one `AWS_*` name on `s`; `false` for a name that is not `AWS_*`. Other `AWS_` names
/// are accepted and ignored (a file or Secret shared with other AWS tools).
fn apply(s: &mut S3Settings, name: &str, value: &str) -> bool {
    let v = Some(value.trim().trim_matches('"').to_string()).filter(|v| !v.is_empty());
    match name.trim() {
        "AWS_ACCESS_KEY_ID" => s.access_key_id = v,
        "AWS_SECRET_ACCESS_KEY" => s.secret_access_key = v,
        "AWS_SESSION_TOKEN" => s.session_token = v,
        "AWS_REGION" | "AWS_DEFAULT_REGION" => s.region = v,
        "AWS_ENDPOINT_URL" | "AWS_ENDPOINT_URL_S3" => s.endpoint = v,
        k if k.starts_with("AWS_") => {}
        _ => return false,
    }
    true
}

/// A credential Secret's keys and values, checked to be what a credentials file can hold
/// (`AWS_*` names, one-line UTF-8 values), sorted by key; the error names the Secret and
/// the key, never a value.
pub fn checked_secret_pairs(
    secret: &str,
    data: &std::collections::BTreeMap<String, Vec<u8>>,
) -> Result<Vec<(String, String)>, CredentialsError> {
    let bad = |key: &str, why| CredentialsError::Key {
        secret: secret.to_string(),
        key: key.to_string(),
        why,
    };
    data.iter()
        .map(|(k, v)| {
            if !k.starts_with("AWS_") || k.contains(['=', '\n']) {
                return Err(bad(k, "is not an AWS_ name"));
            }
            let v =
                std::str::from_utf8(v).map_err(|_| bad(k, "holds a value that is not UTF-8"))?;
            let v = v.trim_end_matches(['\r', '\n']);
            if v.contains(['\r', '\n']) {
                return Err(bad(k, "holds a value of more than one line"));
            }
            Ok((k.clone(), v.to_string()))
        })
        .collect()
}

/// The settings of checked pairs ([`checked_secret_pairs`]) over this process's
/// environment: a name the pairs give wins.
pub fn settings_from_pairs(pairs: &[(String, String)]) -> S3Settings {
    let mut s = S3Settings::from_env();
    for (k, v) in pairs {
        apply(&mut s, k, v);
    }
    s
}

/// Writes checked pairs as a credentials file [`settings_from_file`] reads, readable by its
/// owner only, atomically (a job process starting meanwhile reads the old or the new one).
pub fn write_credentials_file(path: &Path, pairs: &[(String, String)]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    for (k, v) in pairs {
        writeln!(f, "{k}={v}")?;
    }
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Reads `AWS_ACCESS_KEY_ID=...`-style lines (blank lines and `#` comments allowed) over
/// the settings of this process's environment: a name the file gives wins.
pub fn settings_from_file(path: &Path) -> Result<S3Settings, CredentialsError> {
    let text = std::fs::read_to_string(path).map_err(|source| CredentialsError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let mut s = S3Settings::from_env();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || CredentialsError::Syntax {
            path: path.display().to_string(),
            line: i + 1,
        };
        let (k, v) = line.split_once('=').ok_or_else(bad)?;
        if !apply(&mut s, k, v) {
            return Err(bad());
        }
    }
    Ok(s)
}

/// The target configuration of a reference.
pub fn config(t: &TargetRef) -> Result<TargetConfig, CredentialsError> {
    let s3 = match &t.credentials {
        Some(p) => settings_from_file(p)?,
        None => S3Settings::from_env(),
    };
    Ok(TargetConfig::with_settings(t.url.clone(), s3))
}

/// Opens the store of a target (checking it with real requests).
pub async fn open(t: &TargetRef, opts: StoreOptions) -> anyhow::Result<BackupStore> {
    let cfg = config(t)?;
    Ok(BackupStore::open(&cfg, opts).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credentials_file_overrides_the_environment_and_refuses_garbage() {
        let dir = tempfile::tempdir().expect("dir");
        let p = dir.path().join("c");
        std::fs::write(
            &p,
            "# moto\nAWS_ACCESS_KEY_ID=ak\nAWS_SECRET_ACCESS_KEY=\"sk\"\n\nAWS_ENDPOINT_URL=http://127.0.0.1:9\n",
        )
        .expect("write");
        let s = settings_from_file(&p).expect("parse");
        assert_eq!(s.access_key_id.as_deref(), Some("ak"));
        assert_eq!(s.secret_access_key.as_deref(), Some("sk"));
        assert_eq!(s.endpoint.as_deref(), Some("http://127.0.0.1:9"));
        std::fs::write(&p, "password hunter2\n").expect("write");
        let e = settings_from_file(&p).expect_err("garbage").to_string();
        assert!(e.contains("line 1") && !e.contains("hunter2"), "{e}");
    }

    #[test]
    fn a_secrets_pairs_round_trip_through_a_private_file_and_bad_keys_are_named() {
        let dir = tempfile::tempdir().expect("dir");
        let data: std::collections::BTreeMap<String, Vec<u8>> = [
            ("AWS_ACCESS_KEY_ID", "ak\n"),
            ("AWS_SECRET_ACCESS_KEY", "s=k"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:9"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect();
        let pairs = checked_secret_pairs("s3", &data).expect("pairs");
        let from_pairs = settings_from_pairs(&pairs);
        let p = dir.path().join("creds/s3.env");
        write_credentials_file(&p, &pairs).expect("write");
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&p).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let from_file = settings_from_file(&p).expect("read");
        assert_eq!(from_file.access_key_id.as_deref(), Some("ak"));
        assert_eq!(from_file.secret_access_key.as_deref(), Some("s=k"));
        assert_eq!(from_pairs.secret_access_key, from_file.secret_access_key);
        assert_eq!(from_pairs.endpoint, from_file.endpoint);

        for (key, value, why) in [
            ("password", "hunter2", "not an AWS_ name"),
            (
                "AWS_SECRET_ACCESS_KEY",
                "hunter2\nAWS_X=1",
                "more than one line",
            ),
        ] {
            let bad = [(key.to_string(), value.as_bytes().to_vec())].into();
            let e = checked_secret_pairs("s3", &bad).expect_err(key).to_string();
            assert!(
                e.contains(why) && e.contains(key) && !e.contains("hunter2"),
                "{e}"
            );
        }
    }
}
