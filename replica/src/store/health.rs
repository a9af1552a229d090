//! A replica that notices its own files going away (issue 18, finding 7).
//!
//! The replica keeps its layer files open, so a layer file unlinked under it (an operator's
//! `rm`, a cleanup script) goes on taking writes and flushes into an inode that no longer has
//! a name: every answer OK, and after a restart the data is gone. A file truncated under it
//! reads as zeros past the cut, with status OK. Neither may happen silently.
//!
//! [`Replica::check_files`] looks at every open layer file and checksum file through its
//! descriptor (a `statx` of size and link count only: `fsops::size_links` says why): a link
//! count of 0 means unlinked, a layer file shorter than its layer's size means truncated
//! (layer files are created at their full, sparse, size and never shrink while open). The
//! head's files are checked before a flush is answered (a flush must never be answered for
//! data that went into a file that is gone), every file every [`CHECK_INTERVAL`] on a timer,
//! so an idle replica notices too. The first finding makes the replica *lost* for good:
//! every later request fails with [`ReplicaError::Lost`] (an I/O error, so the engine makes
//! it ERR and serves from the others) until the process is restarted on a directory an
//! operator has repaired or replaced.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::fsops::size_links;
use super::{LayerId, Replica};
use crate::error::{ReplicaError, Result};

/// How often an open replica checks its files without being asked.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(2);

impl Replica {
    /// The reason this replica is lost, if it is (module docs).
    pub fn lost(&self) -> Option<String> {
        self.lost
            .lock()
            .expect("invariant: lost lock not poisoned")
            .clone()
    }

    /// Fails with [`ReplicaError::Lost`] once the replica is lost.
    pub(super) fn check_not_lost(&self) -> Result<()> {
        match self.lost() {
            Some(why) => Err(ReplicaError::Lost(why)),
            None => Ok(()),
        }
    }

    /// Checks every open layer and checksum file (module docs); the first problem found makes
    /// the replica lost and is returned.
    pub fn check_files(&self) -> Result<()> {
        self.check_files_where(|_| true)
    }

    /// Checks the head's layer and checksum files only: what a flush makes durable. The
    /// snapshots' files take no writes, so the timer's whole check covers them; this keeps a
    /// flush's cost the same however long the chain is.
    pub(super) fn check_head_files(&self) -> Result<()> {
        let head = self.chain().head;
        self.check_files_where(|id| id == head)
    }

    fn check_files_where(&self, wanted: impl Fn(LayerId) -> bool) -> Result<()> {
        self.check_not_lost()?;
        let files: Vec<(LayerId, u64, _, _)> = {
            let meta = self.meta();
            let chain = self.chain();
            chain
                .files
                .iter()
                .filter(|(id, _)| wanted(**id))
                .map(|(id, f)| {
                    let size = meta.layer(*id).map_or(0, |l| l.size);
                    (*id, size, f.clone(), chain.sums.get(id).cloned())
                })
                .collect()
        };
        for (id, size, file, sums) in files {
            let name = id.file_name();
            let why = match size_links(file.file()) {
                Err(e) => Some(format!("cannot stat {name}: {e}")),
                Ok(m) if m.nlink == 0 => Some(format!(
                    "{name} was unlinked from {} while open",
                    self.dir.display()
                )),
                Ok(m) if m.len < size => Some(format!(
                    "{name} was truncated to {} bytes, below its layer's {size}",
                    m.len
                )),
                Ok(_) => match sums.map(|s| size_links(s.data_file().file())) {
                    Some(Ok(m)) if m.nlink == 0 => Some(format!(
                        "the checksum file of {name} was unlinked while open"
                    )),
                    _ => None,
                },
            };
            if let Some(why) = why {
                return Err(self.mark_lost(why));
            }
        }
        Ok(())
    }

    pub(super) fn mark_lost(&self, why: String) -> ReplicaError {
        let mut lost = self.lost.lock().expect("invariant: lost lock not poisoned");
        if lost.is_none() {
            tracing::error!(dir = %self.dir.display(), "replica LOST, every request fails from now on: {why}");
            *lost = Some(why.clone());
        }
        ReplicaError::Lost(lost.clone().unwrap_or(why))
    }

    /// Checks the files every [`CHECK_INTERVAL`] until the replica is closed or dropped.
    pub(super) fn spawn_file_watch(self: &Arc<Self>) {
        let weak: Weak<Replica> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(CHECK_INTERVAL).await;
                let Some(r) = weak.upgrade() else { return };
                if r.check_open().is_err() || r.lost().is_some() {
                    return;
                }
                let _ = r.check_files();
            }
        });
    }
}
