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
        let v = Some(v.trim().trim_matches('"').to_string()).filter(|v| !v.is_empty());
        match k.trim() {
            "AWS_ACCESS_KEY_ID" => s.access_key_id = v,
            "AWS_SECRET_ACCESS_KEY" => s.secret_access_key = v,
            "AWS_SESSION_TOKEN" => s.session_token = v,
            "AWS_REGION" | "AWS_DEFAULT_REGION" => s.region = v,
            "AWS_ENDPOINT_URL" | "AWS_ENDPOINT_URL_S3" => s.endpoint = v,
            k if k.starts_with("AWS_") => {}
            _ => return Err(bad()),
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
}
