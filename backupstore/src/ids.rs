//! Identifier newtypes: a raw `String` or byte array never crosses a module boundary meaning
//! "some id".

use std::fmt;

use crate::error::{BackupError, Result};

/// The blake3 hash of a blob's uncompressed bytes: the blob's name everywhere in the store.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash(pub [u8; 32]);

impl ChunkHash {
    /// Hashes `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(*blake3::hash(data).as_bytes())
    }

    /// Parses 64 hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex_decode(s, &mut out)?;
        Some(Self(out))
    }

    /// The first 8 bytes as a number (for compact log lines and hashing sets cheaply).
    pub fn short(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("invariant: 32 >= 8"))
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        hex_encode(&self.0, f)
    }
}

impl serde::Serialize for ChunkHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ChunkHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_hex(&s).ok_or_else(|| serde::de::Error::custom("expected 64 hex digits"))
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({self})")
    }
}

/// A pack object's id: 128 random bits, so concurrent writers never need to agree on names.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackId(pub u128);

impl PackId {
    /// A fresh random id.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// Parses 32 hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 16];
        hex_decode(s, &mut out)?;
        Some(Self(u128::from_be_bytes(out)))
    }
}

impl fmt::Display for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        hex_encode(&self.0.to_be_bytes(), f)
    }
}

impl fmt::Debug for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PackId({self})")
    }
}

/// One backup-writing session (also the name of its session marker).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u128);

impl SessionId {
    /// A fresh random id.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// Parses 32 hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        PackId::from_hex(s).map(|p| Self(p.0))
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        hex_encode(&self.0.to_be_bytes(), f)
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({self})")
    }
}

/// Checks a name used as one object-key segment: 1-128 characters of `[A-Za-z0-9._-]`, not
/// starting with a dot (keys must not climb out of their folder or hide from listings).
fn check_name(kind: &'static str, s: &str) -> Result<()> {
    let ok = !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(BackupError::InvalidName {
            kind,
            name: s.to_string(),
        })
    }
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Checks and wraps a name.
            pub fn new(s: impl Into<String>) -> Result<Self> {
                let s = s.into();
                check_name($kind, &s)?;
                Ok(Self(s))
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = BackupError;
            fn try_from(s: String) -> Result<Self> {
                Self::new(s)
            }
        }

        impl From<$name> for String {
            fn from(n: $name) -> String {
                n.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = BackupError;
            fn from_str(s: &str) -> Result<Self> {
                Self::new(s)
            }
        }
    };
}

name_type!(
    /// A volume family: a volume, its clones and its restores. The unit of deduplication and of
    /// GC; the manager chooses it when a volume is created and passes it on to clones.
    FamilyId,
    "family"
);
name_type!(
    /// A backup's name, unique within its family.
    BackupName,
    "backup"
);

fn hex_encode(bytes: &[u8], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for b in bytes {
        write!(f, "{b:02x}")?;
    }
    Ok(())
}

fn hex_decode(s: &str, out: &mut [u8]) -> Option<()> {
    let s = s.as_bytes();
    if s.len() != out.len() * 2 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        let hi = (s[2 * i] as char).to_digit(16)?;
        let lo = (s[2 * i + 1] as char).to_digit(16)?;
        *o = (hi * 16 + lo) as u8;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_forms_round_trip() {
        let h = ChunkHash::of(b"zebu");
        assert_eq!(ChunkHash::from_hex(&h.to_string()), Some(h));
        let p = PackId(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(p.to_string(), "0123456789abcdef0011223344556677");
        assert_eq!(PackId::from_hex(&p.to_string()), Some(p));
        assert_eq!(PackId::from_hex("xyz"), None);
        assert_eq!(PackId::from_hex("0123456789abcdef0011223344556g77"), None);
    }

    #[test]
    fn names_that_could_escape_their_folder_are_refused() {
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "a b",
            "é",
            &"x".repeat(129),
        ] {
            assert!(BackupName::new(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["b-1", "vol.1_backup-2026", "A"] {
            assert!(FamilyId::new(good).is_ok(), "{good:?} refused");
        }
    }
}
