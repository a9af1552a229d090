//! Authentication at the replica ports (issue 18): an engine proves it holds its volume's
//! secret before a replica lets it fence, read or change anything.
//!
//! The secret is a file (at least [`SECRET_MIN`] bytes, readable by its owner only) that the
//! manager writes for each volume and passes to the engine and to each replica by path,
//! never on a command line or in the environment, where `ps` shows it. A replica started
//! with a secret serves only clients that prove they hold it; one started without serves
//! everyone, as before (and refuses a client that asks to authenticate, which it cannot).
//!
//! # Data frames (TCP and the local socket): challenge-response in the hello
//!
//! ```text
//! client ── hello(version, generation, VOLUME, AUTH = Nc) ──────────────► server
//!        ◄── OK id 0, extensions AUTH = Ns ‖ HMAC(K, "zebu-auth-server" ‖ Nc ‖ Ns ‖ V) ──
//! client ── hello(version, generation, AUTH = HMAC(K, "zebu-auth-client" ‖ Nc ‖ Ns ‖ V ‖ G))
//!        ◄── OK id 0 (the usual welcome) or a refusal, then the connection ends ─────────
//! ```
//!
//! `Nc` and `Ns` are 32 random bytes from each side, `V` the volume uuid named in the hello
//! (empty if none), `G` the generation (8 bytes little-endian) and the version (4 bytes), and
//! HMAC is HMAC-SHA256 keyed with the secret. The server proves itself first, so an engine
//! also learns that it talks to a replica of its volume and not an impostor; the server
//! looks at the generation only after the client's proof checks, so an unauthenticated
//! client fences nothing. [`EXT_AUTH`] is critical: a server without this code refuses the
//! hello instead of serving without authentication.
//!
//! # gRPC (control, sync and the gRPC data stream): a token in every call
//!
//! Every call carries the metadata header [`GRPC_AUTH_HEADER`]: hex of a timestamp (8 bytes,
//! seconds, little-endian), 16 random bytes and `HMAC(K, "zebu-auth-grpc" ‖ timestamp ‖
//! random)`. The replica accepts a token whose time is within [`TOKEN_WINDOW`] of its clock
//! and that it has not seen before in that window ([`ReplayGuard`]), so a token copied off
//! the wire cannot be used again. (The token does not bind the call's method: tonic's
//! interceptors do not see it; TLS would add that. Without TLS, one that can rewrite the
//! traffic of an authenticated connection can still change it; the secret never travels.)

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::frames::EXTENSION_CRITICAL;

/// The hello extension of the challenge-response (module docs); critical.
pub const EXT_AUTH: u16 = EXTENSION_CRITICAL | 2;
/// The metadata header carrying a gRPC call's token.
pub const GRPC_AUTH_HEADER: &str = "zebu-auth";
/// The shortest secret accepted.
pub const SECRET_MIN: usize = 16;
/// The length of each side's nonce and of every proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// How far a gRPC token's time may be from the replica's clock.
pub const TOKEN_WINDOW: Duration = Duration::from_secs(120);

const TOKEN_RANDOM: usize = 16;
const TOKEN_LEN: usize = 8 + TOKEN_RANDOM + PROOF_LEN;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("secret file {path}: {why}")]
    SecretFile { path: String, why: String },
    #[error("authentication failed: {0}")]
    Failed(String),
}

/// A volume's secret. Its bytes are never printed.
#[derive(Clone)]
pub struct Secret {
    key: hmac::Key,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// 32 random bytes from the system's generator.
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut b = [0u8; NONCE_LEN];
    SystemRandom::new()
        .fill(&mut b)
        .expect("invariant: the system random generator works");
    b
}

impl Secret {
    /// A secret from its bytes (a trailing newline is not part of it).
    pub fn from_bytes(b: &[u8]) -> Result<Secret, AuthError> {
        let b = b.strip_suffix(b"\n").unwrap_or(b);
        if b.len() < SECRET_MIN {
            return Err(AuthError::Failed(format!(
                "a secret of {} bytes is shorter than the {SECRET_MIN} required",
                b.len()
            )));
        }
        Ok(Secret {
            key: hmac::Key::new(hmac::HMAC_SHA256, b),
        })
    }

    /// Reads the secret file at `path`, which must be readable by its owner only.
    pub fn load(path: &Path) -> Result<Secret, AuthError> {
        use std::os::unix::fs::PermissionsExt;
        let bad = |why: String| AuthError::SecretFile {
            path: path.display().to_string(),
            why,
        };
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(bad(format!(
                "mode {mode:03o} lets others read it; chmod 600 it"
            )));
        }
        let b = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        Secret::from_bytes(&b).map_err(|e| bad(e.to_string()))
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; PROOF_LEN] {
        let mut ctx = hmac::Context::with_key(&self.key);
        for p in parts {
            ctx.update(p);
        }
        let tag = ctx.sign();
        let mut out = [0u8; PROOF_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    fn verify(&self, parts: &[&[u8]], proof: &[u8]) -> bool {
        let mut msg = Vec::new();
        for p in parts {
            msg.extend_from_slice(p);
        }
        // Constant time in the proof's bytes.
        hmac::verify(&self.key, &msg, proof).is_ok()
    }

    /// The server's half of a frames hello: `Ns ‖ proof`, the value of its [`EXT_AUTH`].
    pub fn server_challenge(&self, nc: &[u8], ns: &[u8; NONCE_LEN], volume: &str) -> Vec<u8> {
        let proof = self.mac(&[b"zebu-auth-server", nc, ns, volume.as_bytes()]);
        let mut v = ns.to_vec();
        v.extend_from_slice(&proof);
        v
    }

    /// Checks a server's challenge (the value of its answer's [`EXT_AUTH`]); returns `Ns`.
    pub fn check_server(
        &self,
        nc: &[u8],
        challenge: &[u8],
        volume: &str,
    ) -> Result<Vec<u8>, AuthError> {
        if challenge.len() != NONCE_LEN + PROOF_LEN {
            return Err(AuthError::Failed(
                "the replica's challenge is malformed".into(),
            ));
        }
        let (ns, proof) = challenge.split_at(NONCE_LEN);
        if !self.verify(&[b"zebu-auth-server", nc, ns, volume.as_bytes()], proof) {
            return Err(AuthError::Failed(
                "the replica does not hold this volume's secret".into(),
            ));
        }
        Ok(ns.to_vec())
    }

    /// The client's proof for the second hello.
    pub fn client_proof(
        &self,
        nc: &[u8],
        ns: &[u8],
        volume: &str,
        version: u32,
        generation: u64,
    ) -> [u8; PROOF_LEN] {
        self.mac(&[
            b"zebu-auth-client",
            nc,
            ns,
            volume.as_bytes(),
            &version.to_le_bytes(),
            &generation.to_le_bytes(),
        ])
    }

    /// Checks a client's proof (the value of its second hello's [`EXT_AUTH`]).
    pub fn check_client(
        &self,
        nc: &[u8],
        ns: &[u8],
        volume: &str,
        version: u32,
        generation: u64,
        proof: &[u8],
    ) -> Result<(), AuthError> {
        let parts: [&[u8]; 6] = [
            b"zebu-auth-client",
            nc,
            ns,
            volume.as_bytes(),
            &version.to_le_bytes(),
            &generation.to_le_bytes(),
        ];
        if proof.len() == PROOF_LEN && self.verify(&parts, proof) {
            Ok(())
        } else {
            Err(AuthError::Failed(
                "the client's proof does not match this volume's secret".into(),
            ))
        }
    }

    /// A fresh token for one gRPC call at `now` (seconds since the epoch).
    pub fn grpc_token(&self, now: u64) -> String {
        let mut random = [0u8; TOKEN_RANDOM];
        SystemRandom::new()
            .fill(&mut random)
            .expect("invariant: the system random generator works");
        let ts = now.to_le_bytes();
        let proof = self.mac(&[b"zebu-auth-grpc", &ts, &random]);
        let mut raw = Vec::with_capacity(TOKEN_LEN);
        raw.extend_from_slice(&ts);
        raw.extend_from_slice(&random);
        raw.extend_from_slice(&proof);
        raw.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Checks a gRPC call's token at `now`, and that `guard` has not seen it.
    pub fn check_grpc_token(
        &self,
        token: Option<&str>,
        now: u64,
        guard: &ReplayGuard,
    ) -> Result<(), AuthError> {
        let token = token.ok_or_else(|| {
            AuthError::Failed(format!(
                "this replica requires authentication: the call carries no {GRPC_AUTH_HEADER} \
                 token (give the client the volume's secret)"
            ))
        })?;
        let raw = unhex(token)
            .filter(|r| r.len() == TOKEN_LEN)
            .ok_or_else(|| AuthError::Failed("the call's token is malformed".into()))?;
        let (ts, rest) = raw.split_at(8);
        let (random, proof) = rest.split_at(TOKEN_RANDOM);
        if !self.verify(&[b"zebu-auth-grpc", ts, random], proof) {
            return Err(AuthError::Failed(
                "the call's token does not match this volume's secret".into(),
            ));
        }
        let mut t = [0u8; 8];
        t.copy_from_slice(ts);
        let at = u64::from_le_bytes(t);
        if at.abs_diff(now) > TOKEN_WINDOW.as_secs() {
            return Err(AuthError::Failed(format!(
                "the call's token is {} s away from this replica's clock (more than {} s)",
                at.abs_diff(now),
                TOKEN_WINDOW.as_secs()
            )));
        }
        guard.first_use(at, random, now)
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The random part of a gRPC token, which identifies it.
type TokenId = [u8; TOKEN_RANDOM];

/// The gRPC tokens seen within [`TOKEN_WINDOW`], so none is accepted twice.
#[derive(Default)]
pub struct ReplayGuard {
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    ids: HashSet<TokenId>,
    by_time: BTreeMap<u64, Vec<TokenId>>,
}

impl ReplayGuard {
    fn first_use(&self, at: u64, random: &[u8], now: u64) -> Result<(), AuthError> {
        let mut key: TokenId = [0u8; TOKEN_RANDOM];
        key.copy_from_slice(random);
        let mut g = self.seen.lock().expect("invariant: replay guard lock");
        let Seen { ids: set, by_time } = &mut *g;
        // Forget tokens too old to be accepted anyway.
        let oldest = now.saturating_sub(TOKEN_WINDOW.as_secs());
        while let Some((&t, _)) = by_time.first_key_value() {
            if t >= oldest {
                break;
            }
            for k in by_time.remove(&t).unwrap_or_default() {
                set.remove(&k);
            }
        }
        if !set.insert(key) {
            return Err(AuthError::Failed("the call's token was used before".into()));
        }
        by_time.entry(at).or_default().push(key);
        Ok(())
    }
}

/// Seconds since the epoch by the system clock.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Secret {
        Secret::from_bytes(s.as_bytes()).expect("secret")
    }

    #[test]
    fn frames_handshake_checks_both_sides() {
        let (a, b) = (k("volume secret one"), k("volume secret two"));
        let nc = nonce();
        let ns = nonce();
        let ch = a.server_challenge(&nc, &ns, "v1");
        assert_eq!(a.check_server(&nc, &ch, "v1").expect("server proof"), ns);
        assert!(b.check_server(&nc, &ch, "v1").is_err(), "wrong secret");
        assert!(a.check_server(&nc, &ch, "v2").is_err(), "another volume");
        let p = a.client_proof(&nc, &ns, "v1", 3, 9);
        a.check_client(&nc, &ns, "v1", 3, 9, &p)
            .expect("client proof");
        assert!(
            a.check_client(&nc, &ns, "v1", 3, 10, &p).is_err(),
            "bound to the generation"
        );
        assert!(b.check_client(&nc, &ns, "v1", 3, 9, &p).is_err());
        assert!(a.check_client(&nc, &ns, "v1", 3, 9, &p[..31]).is_err());
    }

    #[test]
    fn grpc_tokens_are_checked_once_and_in_time() {
        let (a, b) = (k("volume secret one"), k("volume secret two"));
        let g = ReplayGuard::default();
        let t = a.grpc_token(1000);
        a.check_grpc_token(Some(&t), 1010, &g).expect("fresh token");
        assert!(a.check_grpc_token(Some(&t), 1010, &g).is_err(), "replayed");
        let t2 = a.grpc_token(1000);
        assert!(a.check_grpc_token(Some(&t2), 2000, &g).is_err(), "stale");
        assert!(
            b.check_grpc_token(Some(&a.grpc_token(1000)), 1000, &g)
                .is_err()
        );
        assert!(a.check_grpc_token(None, 1000, &g).is_err());
        assert!(a.check_grpc_token(Some("zz"), 1000, &g).is_err());
        assert!(Secret::from_bytes(b"short").is_err());
        assert_eq!(format!("{a:?}"), "Secret(..)");
    }
}
