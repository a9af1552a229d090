//! Backup targets: where the store's objects live.
//!
//! Two URL forms:
//!
//! - `s3://BUCKET@REGION/PREFIX` (`@REGION` and `/PREFIX` optional; the region then comes from
//!   the settings, else `AWS_REGION`). Credentials and endpoint come from [`S3Settings`]: given
//!   explicitly (the manager resolves a Kubernetes Secret named by the target into them) or
//!   from the standard variables `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//!   `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL`. Plain `http://` endpoints are
//!   accepted only on a loopback address, so a local S3-compatible server works and a
//!   mistyped remote endpoint never sends credentials in clear.
//! - `file:///PATH`: a directory (local disk or a mounted NFS share); created if missing.
//!   Files are fsync'ed with their directories before a put returns.
//!
//! [`Target::open`] checks the target with real requests, so a bad URL, a missing bucket,
//! refused credentials and an unreachable endpoint each give one clear error within seconds
//! (connect timeout 3 s, two retries), and probes whether the server honours create-only puts
//! (see [`Target::put_create`]).

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt,
    PutMode, PutOptions, PutPayload, RetryConfig,
};

use crate::error::{BackupError, Result};

/// The largest piece [`Target::get_range_stream`] reads at once from a file target.
const FILE_PIECE: u64 = 1 << 20;

/// A parsed target URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetUrl {
    /// An S3 bucket (or a prefix in it).
    S3 {
        bucket: String,
        region: Option<String>,
        prefix: String,
    },
    /// A directory.
    File { path: PathBuf },
}

impl TargetUrl {
    /// Parses `s3://BUCKET@REGION/PREFIX` or `file:///PATH`.
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |reason: &str| BackupError::BadUrl {
            url: url.to_string(),
            reason: reason.into(),
        };
        if let Some(rest) = url.strip_prefix("s3://") {
            let (authority, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let (bucket, region) = match authority.split_once('@') {
                Some((b, r)) if !r.is_empty() => (b, Some(r.to_string())),
                Some(_) => return Err(bad("empty region after '@'")),
                None => (authority, None),
            };
            // S3 bucket naming rules (3-63 of lowercase letters, digits, dots and hyphens).
            let bucket_ok = (3..=63).contains(&bucket.len())
                && bucket.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-'
                })
                && bucket.as_bytes()[0].is_ascii_alphanumeric();
            if !bucket_ok {
                return Err(bad(
                    "the bucket must be 3-63 characters of a-z, 0-9, '.', '-'",
                ));
            }
            let prefix = prefix.trim_matches('/');
            if prefix.split('/').any(|s| s == "." || s == "..")
                || prefix.contains("//")
                || prefix.contains(['?', '#', '\\'])
            {
                return Err(bad("the prefix must be plain path segments"));
            }
            Ok(Self::S3 {
                bucket: bucket.to_string(),
                region,
                prefix: prefix.to_string(),
            })
        } else if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(bad("a file target needs an absolute path: file:///PATH"));
            }
            let p = std::path::Path::new(path);
            if p.components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err(bad("'..' is not allowed in a file target"));
            }
            Ok(Self::File {
                path: p.to_path_buf(),
            })
        } else {
            Err(bad("expected s3://BUCKET@REGION/PREFIX or file:///PATH"))
        }
    }
}

/// Credentials and endpoint for an S3 target.
#[derive(Clone, Default)]
pub struct S3Settings {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    pub region: Option<String>,
    /// `https://host:port`, or `http://` on a loopback address.
    pub endpoint: Option<String>,
}

impl std::fmt::Debug for S3Settings {
    // Never prints the secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Settings")
            .field("access_key_id", &self.access_key_id)
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl S3Settings {
    /// The standard AWS variables of this process.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            access_key_id: var("AWS_ACCESS_KEY_ID"),
            secret_access_key: var("AWS_SECRET_ACCESS_KEY"),
            session_token: var("AWS_SESSION_TOKEN"),
            region: var("AWS_REGION").or_else(|| var("AWS_DEFAULT_REGION")),
            endpoint: var("AWS_ENDPOINT_URL_S3").or_else(|| var("AWS_ENDPOINT_URL")),
        }
    }
}

/// Everything needed to open a target.
#[derive(Clone, Debug)]
pub struct TargetConfig {
    pub url: String,
    pub s3: S3Settings,
    /// How long a TCP connect may take before the endpoint counts as unreachable.
    pub connect_timeout: Duration,
    /// How long one request may take (a pack part upload included).
    pub request_timeout: Duration,
    /// Retries of a failed request (with backoff) before the error is returned.
    pub max_retries: usize,
}

impl TargetConfig {
    /// A target with settings from the environment.
    pub fn from_env(url: impl Into<String>) -> Self {
        Self::with_settings(url, S3Settings::from_env())
    }

    /// A target with explicit settings (a Secret resolved by the manager).
    pub fn with_settings(url: impl Into<String>, s3: S3Settings) -> Self {
        Self {
            url: url.into(),
            s3,
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(120),
            max_retries: 2,
        }
    }
}

/// An opened target: an object store and the key prefix of the backup store in it.
pub struct Target {
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: String,
    /// The directory of a file target (for sweeping abandoned staged uploads).
    dir: Option<PathBuf>,
    conditional_put: bool,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

fn is_loopback_endpoint(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return false;
    };
    let hostport = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = hostport.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        hostport.rsplit_once(':').map_or(hostport, |(h, _)| h)
    };
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Target {
    /// Opens and checks a target (see the module docs for the errors it tells apart).
    pub async fn open(cfg: &TargetConfig) -> Result<Self> {
        let url = cfg.url.clone();
        let (store, prefix, dir): (Arc<dyn ObjectStore>, String, Option<PathBuf>) =
            match TargetUrl::parse(&url)? {
                TargetUrl::File { path } => {
                    std::fs::create_dir_all(&path)
                        .map_err(|e| BackupError::io(path.display(), e))?;
                    let fs = LocalFileSystem::new_with_prefix(&path)
                        .map_err(|e| BackupError::BadUrl {
                            url: url.clone(),
                            reason: e.to_string(),
                        })?
                        .with_fsync(true);
                    (Arc::new(fs), String::new(), Some(path))
                }
                TargetUrl::S3 {
                    bucket,
                    region,
                    prefix,
                } => {
                    let s3 = &cfg.s3;
                    let region = region.or_else(|| s3.region.clone()).ok_or(
                        BackupError::MissingSetting {
                            url: url.clone(),
                            what: "region",
                            env: "AWS_REGION (or s3://BUCKET@REGION/...)",
                        },
                    )?;
                    let (Some(key), Some(secret)) = (&s3.access_key_id, &s3.secret_access_key)
                    else {
                        return Err(BackupError::MissingSetting {
                            url,
                            what: "credentials",
                            env: "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                        });
                    };
                    // Unsigned payloads: SigV4 would otherwise hash every request body with
                    // SHA-256 before sending it (a second pass over every pack byte, on the
                    // backup's critical path), and what that hash protects is the body in
                    // transit. Here that is covered twice over: plain http is accepted only on
                    // a loopback address (https elsewhere: TLS guards the body), and every
                    // blob is named by its blake3 hash and every pack index carries a crc32c,
                    // checked on every read, so a body damaged anywhere fails its check
                    // instead of restoring as data. The request headers are still signed.
                    let mut b = AmazonS3Builder::new()
                        .with_unsigned_payload(true)
                        .with_bucket_name(&bucket)
                        .with_region(&region)
                        .with_access_key_id(key)
                        .with_secret_access_key(secret)
                        .with_retry(RetryConfig {
                            backoff: BackoffConfig {
                                init_backoff: Duration::from_millis(100),
                                max_backoff: Duration::from_secs(2),
                                base: 2.0,
                            },
                            max_retries: cfg.max_retries,
                            retry_timeout: Duration::from_secs(30),
                        })
                        .with_client_options(
                            ClientOptions::new()
                                .with_connect_timeout(cfg.connect_timeout)
                                .with_timeout(cfg.request_timeout),
                        );
                    if let Some(t) = &s3.session_token {
                        b = b.with_token(t);
                    }
                    if let Some(ep) = &s3.endpoint {
                        let loopback = is_loopback_endpoint(ep);
                        if !ep.starts_with("https://") && !loopback {
                            return Err(BackupError::BadUrl {
                                url,
                                reason: format!(
                                    "endpoint {ep:?}: plain http is allowed only on a loopback address; use https://"
                                ),
                            });
                        }
                        b = b.with_endpoint(ep).with_allow_http(loopback);
                    }
                    let store = b.build().map_err(|e| BackupError::BadUrl {
                        url: url.clone(),
                        reason: e.to_string(),
                    })?;
                    (Arc::new(store), prefix, None)
                }
            };
        let mut t = Self {
            url,
            store,
            prefix,
            dir,
            conditional_put: true,
        };
        t.probe().await?;
        Ok(t)
    }

    /// The target's URL (no secrets in it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether the server refuses a create-only put of an existing key (see [`Self::put_create`]).
    pub fn has_conditional_put(&self) -> bool {
        self.conditional_put
    }

    /// One request that exercises the credentials and the bucket, then the create-only probe.
    async fn probe(&mut self) -> Result<()> {
        let probe_dir = self.key(".probe");
        let first = self.store.list(Some(&probe_dir)).next().await;
        if let Some(Err(e)) = first {
            return Err(self.classify("list", &probe_dir, e));
        }
        let key = self.key(&format!(".probe/{}", crate::ids::SessionId::random()));
        let create = || PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        self.store
            .put_opts(&key, PutPayload::from_static(b"probe"), create())
            .await
            .map_err(|e| self.classify("put", &key, e))?;
        let second = self
            .store
            .put_opts(&key, PutPayload::from_static(b"probe"), create())
            .await;
        self.conditional_put = matches!(second, Err(object_store::Error::AlreadyExists { .. }));
        if let Err(e) = second
            && !matches!(e, object_store::Error::AlreadyExists { .. })
        {
            // A server that rejects the header outright instead of ignoring it.
            tracing::warn!(url = %self.url, error = %e, "create-only put not supported");
        }
        if !self.conditional_put {
            tracing::warn!(
                url = %self.url,
                "server ignores create-only puts: falling back to check-then-put (safe while \
                 writers use distinct backup names, which the manager guarantees)"
            );
        }
        let _ = self.store.delete(&key).await;
        Ok(())
    }

    /// Turns an object-store error into one a user can act on.
    pub(crate) fn classify(
        &self,
        op: &'static str,
        key: &Path,
        e: object_store::Error,
    ) -> BackupError {
        let text = error_chain_text(&e);
        let url = self.url.clone();
        if text.contains("NoSuchBucket") || text.contains("bucket does not exist") {
            let bucket = match TargetUrl::parse(&url) {
                Ok(TargetUrl::S3 { bucket, .. }) => bucket,
                _ => String::new(),
            };
            return BackupError::MissingBucket { url, bucket };
        }
        if matches!(
            e,
            object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. }
        ) || [
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AccessDenied",
            "InvalidToken",
            "ExpiredToken",
        ]
        .iter()
        .any(|c| text.contains(c))
        {
            let detail = [
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "InvalidToken",
                "ExpiredToken",
            ]
            .iter()
            .find(|c| text.contains(*c))
            .map_or_else(|| "permission denied".to_string(), |c| c.to_string());
            return BackupError::BadCredentials { url, detail };
        }
        if matches!(e, object_store::Error::Generic { .. })
            && [
                "error sending request",
                "Connection refused",
                "connect",
                "dns error",
                "timed out",
                "tcp",
            ]
            .iter()
            .any(|c| text.contains(c))
            && !text.contains("status")
        {
            return BackupError::Unreachable {
                url,
                detail: first_line(&text),
            };
        }
        BackupError::Store {
            url,
            op,
            key: key.to_string(),
            source: Box::new(e),
        }
    }

    /// The object key for a path relative to the store's root.
    pub(crate) fn key(&self, rel: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from(rel)
        } else {
            Path::from(format!("{}/{rel}", self.prefix))
        }
    }

    /// A key relative to the store's root, for messages and for listing results.
    pub(crate) fn rel<'a>(&self, key: &'a Path) -> &'a str {
        let s = key.as_ref();
        if self.prefix.is_empty() {
            s
        } else {
            s.strip_prefix(self.prefix.as_str())
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or(s)
        }
    }

    /// The underlying store (for multipart uploads).
    pub(crate) fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Plain put (overwrites).
    pub(crate) async fn put(&self, key: &Path, data: impl Into<PutPayload>) -> Result<()> {
        self.store
            .put(key, data.into())
            .await
            .map_err(|e| self.classify("put", key, e))?;
        Ok(())
    }

    /// Create-only put: `Ok(false)` when the key already exists.
    ///
    /// With servers that honour `If-None-Match: *` (AWS S3 since 2024, MinIO, R2, moto, and
    /// the file target, which publishes with a hard link) this is atomic. A server that
    /// ignores the header (found by the probe in [`Self::open`]) gets a HEAD first and the put
    /// only when the key is absent. That leaves a window in which two writers of the *same*
    /// key could both succeed; the store never has two writers of one key (backup names are
    /// unique per writer, GC lease generations are taken by one GC at a time, and a GC that
    /// lost a race finds the other's lease when it lists them before acting).
    pub(crate) async fn put_create(&self, key: &Path, data: Bytes) -> Result<bool> {
        if !self.conditional_put && self.head(key).await?.is_some() {
            return Ok(false);
        }
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.store.put_opts(key, data.into(), opts).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(self.classify("put", key, e)),
        }
    }

    /// Whole object, or `None` if absent.
    pub(crate) async fn get(&self, key: &Path) -> Result<Option<Bytes>> {
        match self.store.get(key).await {
            Ok(r) => Ok(Some(
                r.bytes().await.map_err(|e| self.classify("get", key, e))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.classify("get", key, e)),
        }
    }

    /// A byte range of an object.
    pub(crate) async fn get_range(&self, key: &Path, range: std::ops::Range<u64>) -> Result<Bytes> {
        self.store
            .get_range(key, range)
            .await
            .map_err(|e| self.classify("get", key, e))
    }

    /// A byte range of an object as a stream of pieces, for reads too large to hold at once
    /// (a restore reads whole packs this way and decodes blob by blob as they arrive).
    ///
    /// S3: one ranged GET whose body is consumed as it comes; a consumer that stops pulling
    /// stops the transfer (TCP flow control), so memory is the consumer's, not the read's.
    /// A file target: sequential reads of at most [`FILE_PIECE`] bytes (object_store's own
    /// file stream reads 8 KiB per blocking call).
    pub(crate) async fn get_range_stream(
        &self,
        key: &Path,
        range: std::ops::Range<u64>,
    ) -> Result<futures::stream::BoxStream<'static, Result<Bytes>>> {
        if self.dir.is_some() {
            let store = self.store.clone();
            let (key2, url) = (key.clone(), self.url.clone());
            let pieces = (range.start..range.end)
                .step_by(FILE_PIECE as usize)
                .map(move |s| s..(s + FILE_PIECE).min(range.end));
            return Ok(futures::stream::iter(pieces)
                .then(move |r| {
                    let (store, key, url) = (store.clone(), key2.clone(), url.clone());
                    async move {
                        store
                            .get_range(&key, r)
                            .await
                            .map_err(|e| BackupError::Store {
                                url,
                                op: "get",
                                key: key.to_string(),
                                source: Box::new(e),
                            })
                    }
                })
                .boxed());
        }
        let opts = GetOptions {
            range: Some(GetRange::Bounded(range.clone())),
            ..Default::default()
        };
        let r = self
            .store
            .get_opts(key, opts)
            .await
            .map_err(|e| self.classify("get", key, e))?;
        if r.range != range {
            return Err(BackupError::CorruptObject {
                object: self.rel(key).to_string(),
                reason: format!("asked for bytes {range:?}, the server sent {:?}", r.range),
            });
        }
        let (key, url) = (key.clone(), self.url.clone());
        Ok(r.into_stream()
            .map(move |piece| {
                piece.map_err(|e| BackupError::Store {
                    url: url.clone(),
                    op: "get",
                    key: key.to_string(),
                    source: Box::new(e),
                })
            })
            .boxed())
    }

    /// The last `n` bytes of an object (all of it if shorter).
    pub(crate) async fn get_suffix(&self, key: &Path, n: u64) -> Result<Bytes> {
        let opts = GetOptions {
            range: Some(GetRange::Suffix(n)),
            ..Default::default()
        };
        let r = self
            .store
            .get_opts(key, opts)
            .await
            .map_err(|e| self.classify("get", key, e))?;
        r.bytes().await.map_err(|e| self.classify("get", key, e))
    }

    /// Metadata, or `None` if absent.
    pub(crate) async fn head(&self, key: &Path) -> Result<Option<ObjectMeta>> {
        match self.store.head(key).await {
            Ok(m) => Ok(Some(m)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.classify("head", key, e)),
        }
    }

    /// Deletes; absent is fine.
    pub(crate) async fn delete(&self, key: &Path) -> Result<()> {
        match self.store.delete(key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.classify("delete", key, e)),
        }
    }

    /// Every object under a folder (relative to the root), paginated by the client.
    pub(crate) async fn list(&self, rel_dir: &str) -> Result<Vec<ObjectMeta>> {
        let dir = self.key(rel_dir);
        let mut s = self.store.list(Some(&dir));
        let mut out = Vec::new();
        while let Some(m) = s.next().await {
            out.push(m.map_err(|e| self.classify("list", &dir, e))?);
        }
        Ok(out)
    }

    /// Immediate sub-folders of a folder (relative names).
    pub(crate) async fn list_dirs(&self, rel_dir: &str) -> Result<Vec<String>> {
        let dir = self.key(rel_dir);
        let r = self
            .store
            .list_with_delimiter(Some(&dir))
            .await
            .map_err(|e| self.classify("list", &dir, e))?;
        Ok(r.common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    /// Removes uploads that a killed writer left half-done, older than `age`.
    ///
    /// A file target stages a multipart upload in a `KEY#N` file that listings never show; a
    /// writer killed mid-pack leaves one behind. S3 keeps incomplete multipart uploads out of
    /// sight too, but object_store cannot list them: give the bucket a lifecycle rule
    /// (`AbortIncompleteMultipartUpload`, a day is plenty) for that.
    pub(crate) fn sweep_staged_uploads(&self, rel_dir: &str, age: Duration) -> Result<usize> {
        let Some(root) = &self.dir else { return Ok(0) };
        let dir = root.join(rel_dir);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(BackupError::io(dir.display(), e)),
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let staged = name
                .rsplit_once('#')
                .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|e| e >= age);
            if staged && old && std::fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

fn error_chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = format!("{e} | {e:?}");
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(" | ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn first_line(s: &str) -> String {
    s.split(" | ")
        .next()
        .unwrap_or(s)
        .chars()
        .take(200)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_urls_parse_with_and_without_region_and_prefix() {
        assert_eq!(
            TargetUrl::parse("s3://my-bucket@us-east-1/zebu/backups").unwrap(),
            TargetUrl::S3 {
                bucket: "my-bucket".into(),
                region: Some("us-east-1".into()),
                prefix: "zebu/backups".into()
            }
        );
        assert_eq!(
            TargetUrl::parse("s3://my-bucket").unwrap(),
            TargetUrl::S3 {
                bucket: "my-bucket".into(),
                region: None,
                prefix: String::new()
            }
        );
        assert_eq!(
            TargetUrl::parse("file:///var/backups").unwrap(),
            TargetUrl::File {
                path: "/var/backups".into()
            }
        );
    }

    #[test]
    fn malformed_urls_say_what_is_wrong() {
        for (url, why) in [
            ("http://bucket/x", "expected s3://"),
            ("s3://", "bucket"),
            ("s3://Upper@us-east-1/x", "bucket"),
            ("s3://bucket@/x", "region"),
            ("s3://bucket/../x", "prefix"),
            ("file://relative/path", "absolute"),
            ("file:///a/../b", "'..'"),
        ] {
            let e = TargetUrl::parse(url).unwrap_err().to_string();
            assert!(e.contains(why), "{url}: {e}");
        }
    }

    #[test]
    fn only_loopback_endpoints_may_use_plain_http() {
        assert!(is_loopback_endpoint("http://127.0.0.1:9000"));
        assert!(is_loopback_endpoint("http://127.0.0.5:9000/"));
        assert!(is_loopback_endpoint("http://localhost:9000"));
        assert!(is_loopback_endpoint("http://[::1]:9000"));
        assert!(!is_loopback_endpoint("http://10.0.0.1:9000"));
        assert!(!is_loopback_endpoint("http://s3.example.com"));
        assert!(!is_loopback_endpoint("https://127.0.0.1:9000"));
    }
}
