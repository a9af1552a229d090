//! Making a Kubernetes client that cannot panic over rustls's crypto provider.
//!
//! rustls chooses its process-wide provider from its crate features only when exactly one
//! of `ring` and `aws-lc-rs` is enabled. A binary with both the kube client (ring) and the
//! S3 backup target (object_store: aws-lc-rs) has both, and then the first TLS client kube
//! builds panics ("Could not automatically determine the process-level CryptoProvider").
//! Every Kubernetes client in Zebu is made here, after ring is installed once.

use std::sync::Once;

/// Install ring as the process's rustls provider, once; a provider installed before (by
/// anyone) is kept, as it serves as well.
pub fn ensure_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err means a provider is installed already: nothing to do.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A client for `config`, with the crypto provider settled first.
pub fn from_config(config: kube::Config) -> Result<kube::Client, kube::Error> {
    ensure_crypto_provider();
    kube::Client::try_from(config)
}
