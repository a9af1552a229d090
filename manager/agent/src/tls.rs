//! TLS on the replica ports of a cluster (issue 18, item 2), an option of `zebu up`
//! (`--replica-tls`) and of `zebu manager` (`--replica-tls-ca DIR`).
//!
//! One CA per cluster, one certificate per node:
//!
//! - **The CA** is a certificate and its key, PEM, in one directory: `ca.crt` and `ca.key`,
//!   or `tls.crt` and `tls.key` (a Kubernetes Secret of type `kubernetes.io/tls` mounted by
//!   the chart). `zebu up --replica-tls` makes one in `<data-dir>/tls/ca/` at its first start
//!   and keeps it ([`CaFiles::ensure`]); in a cluster the operator makes it once and stores
//!   it as that Secret. Every node holds the CA's key, so any node can issue its own
//!   certificate: whoever can read a node's data directory can already read its replicas.
//! - **A node's certificate** is issued by its manager at every start ([`CaFiles::issue`]),
//!   for the node's address (an IP subject alternative name: engines and the manager's jobs
//!   dial replicas by IP and check the certificate against it), valid ten years, with a
//!   fresh P-256 key of mode 0600. It goes to `<dir>/replica.crt` and `replica.key`, with a
//!   copy of the CA certificate as `<dir>/ca.crt`, all in the node's data directory, where
//!   the processes the instance manager starts can read them too.
//! - **Who uses what** ([`ReplicaTls`]): the agent starts every replica with `--tls-cert` and
//!   `--tls-key` (its port then speaks only TLS; the local socket stays plain, it never
//!   leaves the host) and every engine with `--tls-ca`; the manager's own replica clients
//!   (volume copies in `zebu_ops`, backup, restore and standby jobs) trust the same CA.
//!
//! No rotation yet: a process keeps the certificate it started with, and all are signed by
//! the one CA, so new and old interoperate. Replacing the CA needs every replica and engine
//! of the cluster restarted.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// What went wrong making or reading the cluster's TLS files; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("replica TLS: {path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("replica TLS: no CA in {dir}: expected ca.crt and ca.key, or tls.crt and tls.key")]
    NoCa { dir: PathBuf },
    #[error("replica TLS: {what}: {source}")]
    Cert {
        what: String,
        #[source]
        source: rcgen::Error,
    },
}

/// The CA a cluster's replica certificates are signed by: its certificate and key files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The files one node's processes get: its replicas serve `cert`/`key`, its engines and
/// the manager's replica clients trust `ca`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl ReplicaTls {
    /// The connector that trusts this node's CA, for the manager's own replica clients.
    pub fn connector(&self) -> Result<zebu_proto::tls::TlsConnector, zebu_proto::tls::TlsError> {
        zebu_proto::tls::connector(&self.ca)
    }
}

fn file_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsSetupError + '_ {
    move |source| TlsSetupError::File {
        path: path.to_path_buf(),
        source,
    }
}

fn cert_err(what: impl Into<String>) -> impl FnOnce(rcgen::Error) -> TlsSetupError {
    let what = what.into();
    move |source| TlsSetupError::Cert { what, source }
}

/// Writes `data` to `path` with `mode`: under a temporary name, synced, renamed, so a process
/// starting meanwhile reads the old file or the new one, never half of one.
fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), TlsSetupError> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(file_err(dir))?;
    let name = path
        .file_name()
        .map_or_else(|| "tls".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(file_err(&tmp))?;
    f.write_all(data)
        .and_then(|()| f.sync_all())
        .map_err(file_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(file_err(path))
}

/// Years since 1970 of the system clock, for validity dates (a day's precision is plenty).
fn this_year() -> i32 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    1970 + i32::try_from(secs / 31_556_952).unwrap_or(0)
}

/// Valid from the start of last year (a node whose clock is behind still accepts it) for
/// `years` years.
fn validity(params: &mut CertificateParams, years: i32) {
    let now = this_year();
    params.not_before = rcgen::date_time_ymd(now - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(now + years, 1, 1);
}

impl CaFiles {
    /// The CA in `dir`: `ca.crt`/`ca.key`, else `tls.crt`/`tls.key` (a mounted Secret).
    pub fn find(dir: &Path) -> Result<CaFiles, TlsSetupError> {
        for (cert, key) in [("ca.crt", "ca.key"), ("tls.crt", "tls.key")] {
            let files = CaFiles {
                cert: dir.join(cert),
                key: dir.join(key),
            };
            if files.cert.is_file() && files.key.is_file() {
                return Ok(files);
            }
        }
        Err(TlsSetupError::NoCa {
            dir: dir.to_path_buf(),
        })
    }

    /// The CA in `dir`, made there (`ca.crt`, `ca.key` of mode 0600) if it has none.
    pub fn ensure(dir: &Path) -> Result<CaFiles, TlsSetupError> {
        if let Ok(found) = CaFiles::find(dir) {
            return Ok(found);
        }
        let key = KeyPair::generate().map_err(cert_err("a CA key"))?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "Zebu replica CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut params, 20);
        let cert = params.self_signed(&key).map_err(cert_err("the CA"))?;
        let files = CaFiles {
            cert: dir.join("ca.crt"),
            key: dir.join("ca.key"),
        };
        // The key first: a certificate without its key is not taken for a CA above.
        write_file(&files.key, key.serialize_pem().as_bytes(), 0o600)?;
        write_file(&files.cert, cert.pem().as_bytes(), 0o644)?;
        tracing::info!(ca = %files.cert.display(), "made the cluster's replica CA");
        Ok(files)
    }

    /// Issues the certificate of node `node` at `address`, signed by this CA, into `dir`
    /// (see the module docs); returns the node's files.
    pub fn issue(
        &self,
        node: &str,
        address: IpAddr,
        dir: &Path,
    ) -> Result<ReplicaTls, TlsSetupError> {
        let ca_pem = std::fs::read_to_string(&self.cert).map_err(file_err(&self.cert))?;
        let ca_key_pem = std::fs::read_to_string(&self.key).map_err(file_err(&self.key))?;
        let ca_key = KeyPair::from_pem(&ca_key_pem)
            .map_err(cert_err(format!("the CA key {}", self.key.display())))?;
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(cert_err(format!(
            "the CA certificate {}",
            self.cert.display()
        )))?;
        let mut params = CertificateParams::new(vec![address.to_string()])
            .map_err(cert_err(format!("a certificate for {address}")))?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("zebu replicas of {node}"));
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, 10);
        let key = KeyPair::generate().map_err(cert_err("a node key"))?;
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(cert_err(format!("signing {node}'s certificate")))?;
        let files = ReplicaTls {
            ca: dir.join("ca.crt"),
            cert: dir.join("replica.crt"),
            key: dir.join("replica.key"),
        };
        write_file(&files.ca, ca_pem.as_bytes(), 0o644)?;
        write_file(&files.key, key.serialize_pem().as_bytes(), 0o600)?;
        write_file(&files.cert, cert.pem().as_bytes(), 0o644)?;
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).expect("stat").permissions().mode() & 0o777
    }

    /// A CA made once and kept; a node certificate it signed is accepted by a client that
    /// trusts the CA when dialled at the node's address, and refused at another address or
    /// by a client that trusts another CA: the checks the engine makes, over real TCP.
    #[tokio::test]
    async fn a_node_certificate_is_trusted_at_its_address_only_and_by_its_ca_only() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let ca = CaFiles::ensure(&tmp.path().join("ca")).expect("CA");
        assert_eq!(mode(&ca.key), 0o600);
        let again = CaFiles::ensure(&tmp.path().join("ca")).expect("CA again");
        assert_eq!(again, ca);
        let first = std::fs::read(&ca.cert).expect("read");
        assert_eq!(std::fs::read(&again.cert).expect("read"), first, "kept");

        let node = ca
            .issue(
                "node-1",
                "127.0.0.1".parse().expect("ip"),
                &tmp.path().join("n1"),
            )
            .expect("issue");
        assert_eq!(mode(&node.key), 0o600);
        assert_eq!(std::fs::read(&node.ca).expect("read"), first);
        let other_ca = CaFiles::ensure(&tmp.path().join("other")).expect("another CA");

        let acceptor = zebu_proto::tls::acceptor(&node.cert, &node.key).expect("acceptor");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let a = acceptor.clone();
                tokio::spawn(async move {
                    let _ = a.accept(tcp).await;
                });
            }
        });
        let trusting = node.connector().expect("connector");
        zebu_proto::tls::connect(&trusting, &format!("127.0.0.1:{port}"))
            .await
            .expect("the node's CA accepts its certificate at its address");
        // The same server dialled by another address of this host: not the certificate's.
        let e = zebu_proto::tls::connect(&trusting, &format!("localhost:{port}"))
            .await
            .expect_err("another name is refused");
        assert!(e.to_string().contains("certificate"), "{e}");
        let stranger = zebu_proto::tls::connector(&other_ca.cert).expect("connector");
        let e = zebu_proto::tls::connect(&stranger, &format!("127.0.0.1:{port}"))
            .await
            .expect_err("another CA is refused");
        assert!(e.to_string().contains("certificate"), "{e}");
    }

    #[test]
    fn a_directory_without_a_ca_is_named() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::write(tmp.path().join("tls.crt"), "x").expect("write");
        let e = CaFiles::find(tmp.path()).expect_err("no key");
        assert!(e.to_string().contains("tls.key"), "{e}");
        std::fs::write(tmp.path().join("tls.key"), "y").expect("write");
        let ca = CaFiles::find(tmp.path()).expect("a mounted Secret's layout");
        assert_eq!(ca.cert, tmp.path().join("tls.crt"));
        let e = ca
            .issue("n", "127.0.0.1".parse().expect("ip"), tmp.path())
            .expect_err("not PEM");
        assert!(e.to_string().contains("tls.key"), "{e}");
    }
}
