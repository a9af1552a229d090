//! A small HTTP/1 client for the manager's REST API, used by the `zebu` CLI.
//!
//! One connection per request (the CLI makes one or two), plain HTTP to a
//! loopback or cluster-internal address. Non-2xx answers become
//! [`ClientError::Api`] carrying the server's `{"error": ...}` message, so the
//! CLI can print it as-is.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
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
    Api { status: StatusCode, message: String },
    #[error("invalid response from {addr}: {reason}")]
    Invalid { addr: String, reason: String },
}

/// Talks to one API endpoint, `host:port`.
#[derive(Debug, Clone)]
pub struct Client {
    addr: String,
}

impl Client {
    /// `api` is `http://host:port` or `host:port`.
    pub fn new(api: &str) -> Self {
        let addr = api
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        Client { addr }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
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
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.addr)
            .header("content-type", "application/json")
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
        let message = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_else(|| format!("{status}: {}", String::from_utf8_lossy(&body).trim()));
        Err(ClientError::Api { status, message })
    }

    /// One request, the JSON answer.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
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

    /// A streaming request: calls `each` for every JSON line until the server
    /// closes the stream or `each` returns false.
    pub async fn stream_lines(
        &self,
        path: &str,
        mut each: impl FnMut(Value) -> bool,
    ) -> Result<(), ClientError> {
        let mut body = self.send(Method::GET, path, None).await?.into_body();
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
