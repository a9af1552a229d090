//! A typed client of the manager's REST API (see `zebu-api`), used by the `zebu` CLI.
//!
//! One connection per request (the CLI makes one or two), plain HTTP to a loopback or
//! cluster-internal address. Names go into paths percent-encoded, so `vol#frag` or
//! `x/../../v1/nodes` reach the server as one path segment (which refuses them) instead of
//! becoming a fragment or another path. Non-2xx answers become [`ClientError::Api`] with the
//! server's `{"error": ...}` message, so the CLI can print it as it is.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::net::TcpStream;
use zebu_types::requests::{
    AttachVolume, Capacity, CreateSnapshot, CreateVolume, ExpandVolume, Items, SnapshotInfo,
    StartScrub,
};
use zebu_types::resources::{Node, ScrubInfo, Snapshot, Volume};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid API address {api:?}: {reason}")]
    BadAddress { api: String, reason: String },
    #[error(
        "cannot reach the zebu API at {addr}: {source} (is `zebu up` running? set --api or ZEBU_API)"
    )]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP error talking to {addr}: {source}")]
    Http {
        addr: String,
        #[source]
        source: hyper::Error,
    },
    #[error("{message}")]
    Api {
        status: StatusCode,
        message: String,
        /// The gRPC code name the operation's error maps to, when the server says.
        code: Option<String>,
    },
    #[error("invalid response from {addr}: {reason}")]
    Invalid { addr: String, reason: String },
}

/// What `DELETE /v1/volumes/{name}` answers.
#[derive(Debug, Clone, serde::Deserialize, Serialize)]
pub struct Deleted {
    /// Gone at once (`false`: its finalizer holds it while its engine and replicas go).
    pub deleted: bool,
    pub object: Option<Volume>,
}

/// One path segment, percent-encoded: everything but ASCII letters, digits, `-`, `_` and
/// `~` (a `.` too, so `..` cannot climb the path).
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Talks to one API endpoint.
#[derive(Debug, Clone)]
pub struct Client {
    /// `host:port`.
    addr: String,
}

impl Client {
    /// `api` is `http://HOST:PORT` or `HOST:PORT`; any other scheme, a path or a missing
    /// port is refused here, before anything is sent or looked up.
    pub fn new(api: &str) -> Result<Self, ClientError> {
        let bad = |reason: String| ClientError::BadAddress {
            api: api.to_string(),
            reason,
        };
        let rest = match api.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
            Some((scheme, _)) => {
                return Err(bad(format!(
                    "unsupported scheme {scheme:?}: the zebu API speaks plain HTTP (http://HOST:PORT)"
                )));
            }
            None => api,
        };
        let addr = rest.strip_suffix('/').unwrap_or(rest);
        if addr.is_empty() {
            return Err(bad("no host (expected http://HOST:PORT)".into()));
        }
        if addr.contains(['/', '?', '#', '@']) || addr.chars().any(char::is_whitespace) {
            return Err(bad("expected http://HOST:PORT, without a path".into()));
        }
        let port = addr.rsplit_once(':').map(|(_, p)| p);
        if port.is_none_or(|p| p.parse::<u16>().is_err()) || addr.ends_with(']') {
            return Err(bad("no port (expected http://HOST:PORT)".into()));
        }
        Ok(Client {
            addr: addr.to_string(),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ClientError> {
        let stream =
            TcpStream::connect(&self.addr)
                .await
                .map_err(|source| ClientError::Connect {
                    addr: self.addr.clone(),
                    source,
                })?;
        let http = |source| ClientError::Http {
            addr: self.addr.clone(),
            source,
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(http)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("API connection ended: {e}");
            }
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.addr);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        let req = req
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| ClientError::Invalid {
                addr: self.addr.clone(),
                reason: e.to_string(),
            })?;
        let resp = sender.send_request(req).await.map_err(http)?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(http)?.to_bytes();
        let json = serde_json::from_slice::<Value>(&body).ok();
        let message = json
            .as_ref()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_else(|| format!("{status}: {}", String::from_utf8_lossy(&body).trim()));
        let code = json
            .as_ref()
            .and_then(|v| v.get("code").and_then(Value::as_str).map(str::to_string));
        Err(ClientError::Api {
            status,
            message,
            code,
        })
    }

    /// One request, the JSON answer decoded.
    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T, ClientError> {
        let body =
            body.map(serde_json::to_value)
                .transpose()
                .map_err(|e| ClientError::Invalid {
                    addr: self.addr.clone(),
                    reason: format!("encoding the request: {e}"),
                })?;
        let resp = self.send(method, path, body).await?;
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|source| ClientError::Http {
                addr: self.addr.clone(),
                source,
            })?
            .to_bytes();
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Invalid {
            addr: self.addr.clone(),
            reason: e.to_string(),
        })
    }

    pub(crate) const NO_BODY: Option<&'static Value> = None;

    pub async fn list_volumes(&self) -> Result<Items<Volume>, ClientError> {
        self.call(Method::GET, "/v1/volumes", Self::NO_BODY).await
    }

    pub async fn get_volume(&self, name: &str) -> Result<Volume, ClientError> {
        let path = format!("/v1/volumes/{}", segment(name));
        self.call(Method::GET, &path, Self::NO_BODY).await
    }

    /// The volume, `None` when the API says it does not exist.
    pub async fn find_volume(&self, name: &str) -> Result<Option<Volume>, ClientError> {
        match self.get_volume(name).await {
            Ok(v) => Ok(Some(v)),
            Err(ClientError::Api { status, .. }) if status == StatusCode::NOT_FOUND => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn create_volume(&self, req: &CreateVolume) -> Result<Volume, ClientError> {
        self.call(Method::POST, "/v1/volumes", Some(req)).await
    }

    pub async fn delete_volume(&self, name: &str) -> Result<Deleted, ClientError> {
        let path = format!("/v1/volumes/{}", segment(name));
        self.call(Method::DELETE, &path, Self::NO_BODY).await
    }

    pub async fn attach_volume(
        &self,
        name: &str,
        req: &AttachVolume,
    ) -> Result<Volume, ClientError> {
        let path = format!("/v1/volumes/{}/attach", segment(name));
        self.call(Method::POST, &path, Some(req)).await
    }

    pub async fn detach_volume(&self, name: &str) -> Result<Volume, ClientError> {
        let path = format!("/v1/volumes/{}/detach", segment(name));
        self.call(Method::POST, &path, Self::NO_BODY).await
    }

    pub async fn expand_volume(
        &self,
        name: &str,
        req: &ExpandVolume,
    ) -> Result<Volume, ClientError> {
        let path = format!("/v1/volumes/{}/expand", segment(name));
        self.call(Method::POST, &path, Some(req)).await
    }

    pub async fn list_nodes(&self) -> Result<Items<Node>, ClientError> {
        self.call(Method::GET, "/v1/nodes", Self::NO_BODY).await
    }

    pub async fn list_snapshots(&self, volume: &str) -> Result<Items<SnapshotInfo>, ClientError> {
        let path = format!("/v1/volumes/{}/snapshots", segment(volume));
        self.call(Method::GET, &path, Self::NO_BODY).await
    }

    pub async fn create_snapshot(
        &self,
        volume: &str,
        req: &CreateSnapshot,
    ) -> Result<Items<SnapshotInfo>, ClientError> {
        let path = format!("/v1/volumes/{}/snapshots", segment(volume));
        self.call(Method::POST, &path, Some(req)).await
    }

    pub async fn delete_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> Result<Items<SnapshotInfo>, ClientError> {
        let path = format!(
            "/v1/volumes/{}/snapshots/{}",
            segment(volume),
            segment(snapshot)
        );
        self.call(Method::DELETE, &path, Self::NO_BODY).await
    }

    pub async fn revert_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> Result<Items<SnapshotInfo>, ClientError> {
        let path = format!(
            "/v1/volumes/{}/snapshots/{}/revert",
            segment(volume),
            segment(snapshot)
        );
        self.call(Method::POST, &path, Self::NO_BODY).await
    }

    /// Start a scrub of an attached volume.
    pub async fn start_scrub(
        &self,
        name: &str,
        req: &StartScrub,
    ) -> Result<ScrubInfo, ClientError> {
        let path = format!("/v1/volumes/{}/scrub", segment(name));
        self.call(Method::POST, &path, Some(req)).await
    }

    /// Stop a volume's running scrub.
    pub async fn stop_scrub(&self, name: &str) -> Result<ScrubInfo, ClientError> {
        let path = format!("/v1/volumes/{}/scrub/stop", segment(name));
        self.call(Method::POST, &path, Self::NO_BODY).await
    }

    /// A volume's running (or last) scrub and its last recorded one.
    pub async fn scrub_status(&self, name: &str) -> Result<ScrubInfo, ClientError> {
        let path = format!("/v1/volumes/{}/scrub", segment(name));
        self.call(Method::GET, &path, Self::NO_BODY).await
    }

    /// Start (again) the copy into a volume made from a snapshot or a clone, unless it is
    /// done or running; its state (`None`: the volume has no data source).
    pub async fn populate_volume(&self, name: &str) -> Result<Option<String>, ClientError> {
        let path = format!("/v1/volumes/{}/populate", segment(name));
        let v: Value = self.call(Method::POST, &path, Self::NO_BODY).await?;
        Ok(v.get("population")
            .and_then(Value::as_str)
            .map(str::to_string))
    }

    /// `POST /v1/backups/{backup}/restore`: a new volume that restores the backup (the
    /// restore runs on; the volume's `status.restore` says when it is done).
    pub async fn restore_backup(
        &self,
        backup: &str,
        req: &zebu_types::requests::backup::RestoreBackup,
    ) -> Result<Volume, ClientError> {
        let path = format!("/v1/backups/{}/restore", segment(backup));
        self.call(Method::POST, &path, Some(req)).await
    }

    /// `GET /v1/backups[?volume=V]`: the backups of one volume, or all.
    pub async fn list_backups(
        &self,
        volume: Option<&str>,
    ) -> Result<Items<zebu_types::resources::Backup>, ClientError> {
        let path = match volume {
            Some(v) => format!("/v1/backups?volume={}", segment(v)),
            None => "/v1/backups".to_string(),
        };
        self.call(Method::GET, &path, Self::NO_BODY).await
    }

    pub async fn get_backup(
        &self,
        name: &str,
    ) -> Result<zebu_types::resources::Backup, ClientError> {
        let path = format!("/v1/backups/{}", segment(name));
        self.call(Method::GET, &path, Self::NO_BODY).await
    }

    /// A backup, `None` when there is none.
    pub async fn find_backup(
        &self,
        name: &str,
    ) -> Result<Option<zebu_types::resources::Backup>, ClientError> {
        match self.get_backup(name).await {
            Ok(b) => Ok(Some(b)),
            Err(ClientError::Api { status, .. }) if status == StatusCode::NOT_FOUND => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `POST /v1/backups`: back up a volume (the upload runs on; the backup's status says
    /// when it is committed).
    pub async fn create_backup(
        &self,
        req: &zebu_types::requests::backup::CreateBackup,
    ) -> Result<zebu_types::resources::Backup, ClientError> {
        self.call(Method::POST, "/v1/backups", Some(req)).await
    }

    /// `DELETE /v1/backups/{name}`: deletes the backup from the target (its manifest goes
    /// first, then the object).
    pub async fn delete_backup(&self, name: &str) -> Result<Value, ClientError> {
        let path = format!("/v1/backups/{}", segment(name));
        self.call(Method::DELETE, &path, Self::NO_BODY).await
    }

    /// `GET /v1/backuptarget`: the backup target (FailedPrecondition when none is set).
    pub async fn get_backup_target(
        &self,
    ) -> Result<zebu_types::resources::BackupTarget, ClientError> {
        self.call(Method::GET, "/v1/backuptarget", Self::NO_BODY)
            .await
    }

    /// The Snapshot records of one volume, or of every volume.
    pub async fn list_snapshot_records(
        &self,
        volume: Option<&str>,
    ) -> Result<Items<Snapshot>, ClientError> {
        let path = match volume {
            Some(v) => format!("/v1/snapshots?volume={}", segment(v)),
            None => "/v1/snapshots".to_string(),
        };
        self.call(Method::GET, &path, Self::NO_BODY).await
    }

    /// What new replicas can take on one node, one zone, or everywhere.
    pub async fn capacity(
        &self,
        node: Option<&str>,
        zone: Option<&str>,
    ) -> Result<Capacity, ClientError> {
        let mut query = Vec::new();
        if let Some(n) = node {
            query.push(format!("node={}", segment(n)));
        }
        if let Some(z) = zone {
            query.push(format!("zone={}", segment(z)));
        }
        let path = if query.is_empty() {
            "/v1/capacity".to_string()
        } else {
            format!("/v1/capacity?{}", query.join("&"))
        };
        self.call(Method::GET, &path, Self::NO_BODY).await
    }

    /// `zebu up`'s own routes: stop or start a node's agent.
    pub async fn standalone_node(&self, node: &str, verb: &str) -> Result<Value, ClientError> {
        let path = format!("/v1/standalone/nodes/{}/{verb}", segment(node));
        self.call(Method::POST, &path, Self::NO_BODY).await
    }

    /// The NDJSON watch of one volume: calls `each` for every line until the server closes
    /// the stream or `each` returns false.
    pub async fn watch_volume(
        &self,
        name: &str,
        mut each: impl FnMut(Value) -> bool,
    ) -> Result<(), ClientError> {
        let path = format!("/v1/volumes/{}?watch=true", segment(name));
        let mut body = self.send(Method::GET, &path, None).await?.into_body();
        let mut buf = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|source| ClientError::Http {
                addr: self.addr.clone(),
                source,
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let v = serde_json::from_slice(&line).map_err(|e| ClientError::Invalid {
                    addr: self.addr.clone(),
                    reason: e.to_string(),
                })?;
                if !each(v) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_one_encoded_path_segment() {
        assert_eq!(segment("vol-1"), "vol-1");
        assert_eq!(segment("vol#frag"), "vol%23frag");
        assert_eq!(
            segment("x/../../v1/nodes"),
            "x%2F%2E%2E%2F%2E%2E%2Fv1%2Fnodes"
        );
        assert_eq!(segment("a b?c"), "a%20b%3Fc");
        assert_eq!(segment("é"), "%C3%A9");
    }

    #[test]
    fn api_addresses_are_checked_before_anything_is_sent() {
        for good in [
            "http://127.0.0.1:9500",
            "127.0.0.1:9500",
            "HTTP://h:1/",
            "[::1]:9500",
        ] {
            assert!(Client::new(good).is_ok(), "{good}");
        }
        let e = Client::new("ftp://example.com:21").expect_err("ftp");
        assert!(e.to_string().contains("unsupported scheme \"ftp\""), "{e}");
        let e = Client::new("https://h:443").expect_err("https");
        assert!(
            e.to_string().contains("unsupported scheme \"https\""),
            "{e}"
        );
        for bad in [
            "http://h",
            "h",
            "http://h:1/v1",
            "",
            "http://",
            "h:port",
            "[::1]",
        ] {
            assert!(Client::new(bad).is_err(), "{bad}");
        }
    }
}
