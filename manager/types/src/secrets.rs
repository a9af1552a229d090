//! Each volume's identity and secret (issue 18): issued by the manager at create, recorded
//! on the Volume, handed to its engine and replicas by file.
//!
//! - **Where it is recorded.** Two annotations on the Volume: [`VOLUME_UUID_ANNOTATION`]
//!   (the uuid its engine is started with, `--volume-uuid`, and that its replicas record)
//!   and [`SECRET_NAME_ANNOTATION`] (the name of the secret, `zebu-volume-<volume>`).
//!   Annotations, not spec fields, so that the CRDs do not change and a Volume made before
//!   this release simply has none.
//! - **Where the secret lives.** Behind [`SecretKeeper`], which a store offers
//!   ([`crate::Store::secrets`]): on one host ([`FileSecrets`], the embedded store) a file
//!   of mode 0600 per volume in `<data-dir>/secrets/` (the directory 0700); in Kubernetes a
//!   Secret per volume, owned by the Volume so the garbage collector takes it with it.
//! - **Who reads it.** The node agent asks [`SecretKeeper::local_file`] for a file on its
//!   node and passes its path as `--secret-file` to the engine and to each replica; the
//!   backup jobs get the path in their job file. The secret is never on a command line.
//! - **Upgrade.** A Volume without the annotations (made before this) is served as before:
//!   no `--volume-uuid` (its engine keeps the uuid its replicas record, which that engine
//!   made at their first start, so another volume's replicas are still refused) and no
//!   secret (its replica ports stay open to any client). Re-creating it (backup and
//!   restore, or a clone) gives it both.

use std::path::{Path, PathBuf};

use crate::ObjectMeta;
use crate::store::{BoxFuture, Result, StoreError};

/// On a Volume: its uuid.
pub const VOLUME_UUID_ANNOTATION: &str = "zebu.io/volume-uuid";
/// On a Volume: the name of its secret (a file name on one host, a Secret in Kubernetes).
pub const SECRET_NAME_ANNOTATION: &str = "zebu.io/secret-name";
/// The key of a volume Secret's data that holds the secret.
pub const SECRET_KEY: &str = "secret";

/// The secret name of `volume` (a DNS-1123 subdomain whenever the volume's name is a label).
pub fn secret_name(volume: &str) -> String {
    format!("zebu-volume-{volume}")
}

/// What the manager issued a volume, read off its annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeIdentity {
    pub uuid: String,
    pub secret_name: String,
}

impl VolumeIdentity {
    /// The identity recorded on `meta`, `None` for a volume made before identities (both
    /// annotations are needed).
    pub fn of(meta: &ObjectMeta) -> Option<VolumeIdentity> {
        let uuid = meta.annotations.get(VOLUME_UUID_ANNOTATION)?;
        let secret_name = meta.annotations.get(SECRET_NAME_ANNOTATION)?;
        Some(VolumeIdentity {
            uuid: uuid.clone(),
            secret_name: secret_name.clone(),
        })
    }
}

/// Where volume secrets are kept; see the module docs. Object-safe, like [`crate::Store`].
pub trait SecretKeeper: Send + Sync {
    /// Keeps `value` as the secret `name`, owned by `owner` (the Volume's name and uid).
    /// [`StoreError::AlreadyExists`] if there is one.
    fn create<'a>(
        &'a self,
        name: &'a str,
        owner: &'a ObjectMeta,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<()>>;
    /// The path of a file on this node, mode 0600, holding the secret `name`
    /// ([`StoreError::NotFound`] if there is none).
    fn local_file<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<PathBuf>>;
    /// Removes the secret `name` and this node's file of it; gone already is no error.
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<()>>;
}

/// Secrets as files in one directory (one host: `<data-dir>/secrets/`).
#[derive(Debug, Clone)]
pub struct FileSecrets {
    dir: PathBuf,
}

fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> StoreError {
    move |e| StoreError::Backend {
        context,
        source: Box::new(e),
    }
}

/// A secret's name must be one path component, so it cannot name a file elsewhere.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(StoreError::invalid(
            None,
            format!("secret name {name:?}: expected lowercase letters, digits, '-' and '.'"),
        ))
    }
}

impl FileSecrets {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileSecrets { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of the secret `name`.
    pub fn path(&self, name: &str) -> Result<PathBuf> {
        check_name(name)?;
        Ok(self.dir.join(name))
    }

    /// Writes `value` as the file `name` (0600, made under a temporary name and renamed,
    /// so a reader never sees it half written); refuses to replace one.
    pub fn write(&self, name: &str, value: &[u8]) -> Result<PathBuf> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let path = self.path(name)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(io_err("creating the secrets directory"))?;
        if path.exists() {
            return Err(StoreError::AlreadyExists {
                kind: crate::Kind::Volume,
                name: format!("secret {name}"),
            });
        }
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err("creating a secret file"))?;
        f.write_all(value)
            .and_then(|()| f.sync_all())
            .map_err(io_err("writing a secret file"))?;
        std::fs::rename(&tmp, &path).map_err(io_err("renaming a secret file"))?;
        Ok(path)
    }

    /// Removes the file `name`; gone already is no error.
    pub fn remove(&self, name: &str) -> Result<()> {
        match std::fs::remove_file(self.path(name)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(io_err("removing a secret file")(e))
            }
            _ => Ok(()),
        }
    }
}

impl SecretKeeper for FileSecrets {
    fn create<'a>(
        &'a self,
        name: &'a str,
        _owner: &'a ObjectMeta,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.write(name, value).map(|_| ()) })
    }

    fn local_file<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<PathBuf>> {
        Box::pin(async move {
            let path = self.path(name)?;
            if path.is_file() {
                Ok(path)
            } else {
                Err(StoreError::NotFound {
                    kind: crate::Kind::Volume,
                    name: format!("secret {name}"),
                })
            }
        })
    }

    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.remove(name) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn a_file_secret_is_owner_only_made_once_and_removed() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let keeper = FileSecrets::new(tmp.path().join("secrets"));
        let owner = ObjectMeta::named("db");
        keeper
            .create("zebu-volume-db", &owner, b"0123456789abcdef0123")
            .await
            .expect("create");
        let path = keeper.local_file("zebu-volume-db").await.expect("file");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = std::fs::metadata(keeper.dir())
            .expect("stat")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);
        assert_eq!(std::fs::read(&path).expect("read"), b"0123456789abcdef0123");
        assert!(matches!(
            keeper
                .create("zebu-volume-db", &owner, b"other-secret-bytes")
                .await,
            Err(StoreError::AlreadyExists { .. })
        ));
        assert_eq!(std::fs::read(&path).expect("read"), b"0123456789abcdef0123");
        keeper.delete("zebu-volume-db").await.expect("delete");
        keeper.delete("zebu-volume-db").await.expect("delete again");
        assert!(matches!(
            keeper.local_file("zebu-volume-db").await,
            Err(StoreError::NotFound { .. })
        ));
        assert!(keeper.path("../etc").is_err());
        assert!(keeper.path("a/b").is_err());
    }
}
