//! TLS on the replica ports (issue 18, item 2), an option beside the challenge-response of
//! [`crate::auth`]: off by default. A replica started with a certificate and key
//! (`zebu-replica serve --tls-cert --tls-key`, PEM files) serves its port only over TLS 1.2
//! or 1.3, gRPC and data frames alike (the first decrypted byte chooses, as on a plain
//! port); a client that does not start a TLS handshake is dropped at its first bytes. An
//! engine given the CA that signed the replicas' certificates (`zebu-engine --tls-ca`)
//! connects to every replica over TLS and checks its certificate against the address it
//! dialled (an IP address needs an IP subject alternative name).
//!
//! What TLS adds to the authentication: the traffic is private and cannot be changed on the
//! way (the gRPC token binds no method or message; the frames requests after the hello carry
//! no proof), and a replica proves its identity before any byte of the volume's data goes
//! out. The local socket (a Unix socket in the abstract namespace, on the replica's host
//! only) stays plaintext: its traffic never leaves the host.
//!
//! Both configs use ring explicitly (not the process's default provider, which may be unset
//! or aws-lc-rs in processes that link object_store).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub use tokio_rustls::{TlsAcceptor, TlsConnector, client, server};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS {what} {path}: {why}")]
    File {
        what: &'static str,
        path: String,
        why: String,
    },
    #[error("TLS: {0}")]
    Config(String),
    #[error("TLS: cannot tell the server's name from address {0:?}")]
    Name(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |why: String| TlsError::File {
        what,
        path: path.display().to_string(),
        why,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// The server side: the certificate chain (leaf first) and its private key, PEM files.
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let chain = certs("certificate", cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
        what: "key",
        path: key.display().to_string(),
        why: e.to_string(),
    })?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(format!("certificate and key: {e}")))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The client side: trusts only the certificates in the PEM file `ca`.
pub fn connector(ca: &Path) -> Result<TlsConnector, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certs("CA", ca)? {
        roots.add(c).map_err(|e| TlsError::File {
            what: "CA",
            path: ca.display().to_string(),
            why: e.to_string(),
        })?;
    }
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// The name a replica's certificate must carry for the address `host:port` (or
/// `[v6]:port`) the client dials: its host, an IP address or a DNS name.
pub fn server_name(addr: &str) -> Result<ServerName<'static>, TlsError> {
    let host = match addr.rsplit_once(':') {
        Some((h, port)) if port.parse::<u16>().is_ok() => h,
        _ => addr,
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(host.to_string()).map_err(|_| TlsError::Name(addr.to_string()))
}

/// A TCP connection to `addr` and a TLS handshake on it that checks the replica's
/// certificate against the host in `addr` (see [`server_name`]).
pub async fn connect(
    tls: &TlsConnector,
    addr: &str,
) -> std::io::Result<client::TlsStream<tokio::net::TcpStream>> {
    let name = server_name(addr)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    tls.connect(name, tcp)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("TLS handshake with {addr}: {e}")))
}

/// Connects a gRPC `endpoint` (made for `http://{addr}`) to the replica at `addr`: over
/// plain TCP, or with `tls` over TLS, HTTP/2 running inside it as on a plain port (the
/// replica port speaks h2 without ALPN). Every reconnect of the channel goes through the
/// handshake again, bounded by `timeout`. For the manager's own replica clients (volume
/// copies, backup and restore jobs); the engine has its own, with its data path.
pub async fn grpc_channel(
    endpoint: tonic::transport::Endpoint,
    addr: &str,
    tls: Option<&TlsConnector>,
    timeout: std::time::Duration,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let Some(tls) = tls else {
        return endpoint.connect().await;
    };
    let (tls, addr) = (tls.clone(), addr.to_string());
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let (tls, addr) = (tls.clone(), addr.clone());
        async move {
            let stream = tokio::time::timeout(timeout, connect(&tls, &addr))
                .await
                .map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("TLS connect {addr}: no answer within {timeout:?}"),
                    )
                })??;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    endpoint.connect_with_connector(connector).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_come_from_the_dialled_host() {
        let ip = |s: &str| match server_name(s).expect(s) {
            ServerName::IpAddress(a) => std::net::IpAddr::from(a).to_string(),
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(ip("127.0.0.1:9000"), "127.0.0.1");
        assert_eq!(ip("[::1]:9000"), "::1");
        assert!(matches!(
            server_name("replica-0.zebu:9000").expect("dns"),
            ServerName::DnsName(_)
        ));
        assert!(server_name("bad host:1").is_err());
    }

    #[test]
    fn missing_or_empty_files_are_named() {
        let dir = std::env::temp_dir().join(format!("zebu-tls-test.{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").expect("write");
        let e = connector(&empty)
            .err()
            .expect("an empty CA file")
            .to_string();
        assert!(
            e.contains("empty.pem") && e.contains("no PEM certificate"),
            "{e}"
        );
        let e = acceptor(&dir.join("absent.pem"), &empty)
            .err()
            .expect("a missing certificate")
            .to_string();
        assert!(e.contains("absent.pem"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
