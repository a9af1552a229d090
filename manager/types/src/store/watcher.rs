//! A resumable watch of one kind: list, then watch from the list's version; resume from the
//! last version seen when a watch ends; list again when the store says the version expired.
//! Written over the [`Store`] trait alone, so it behaves the same on every backend.

use std::sync::Arc;

use futures::StreamExt;
use serde_json::Value;

use super::{ListParams, Result, Store, StoreError, WatchEvent, WatchStream};
use crate::{Kind, ResourceVersion};

/// What [`KindWatcher::next`] saw.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchChange {
    /// A (re-)list: every object of the kind now. Anything a caller derived from earlier
    /// events should be rebuilt from this.
    Listed(Vec<Value>),
    /// One change after the last list or change.
    Event(WatchEvent),
}

/// See the module docs. Errors other than expiry are returned as they are, and the next
/// call tries again from the same version; pacing retries is the caller's business.
pub struct KindWatcher {
    store: Arc<dyn Store>,
    kind: Kind,
    /// The version to resume from; `None` until the first list, and after an expiry.
    last: Option<ResourceVersion>,
    stream: Option<WatchStream>,
    /// How many times a list had to be repeated because a watch expired.
    pub relists: u64,
}

impl KindWatcher {
    pub fn new(store: Arc<dyn Store>, kind: Kind) -> Self {
        KindWatcher {
            store,
            kind,
            last: None,
            stream: None,
            relists: 0,
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The version the watcher resumes from (after its first list).
    pub fn resource_version(&self) -> Option<&ResourceVersion> {
        self.last.as_ref()
    }

    /// The next change; see [`WatchChange`].
    pub async fn next(&mut self) -> Result<WatchChange> {
        loop {
            let Some(since) = self.last.clone() else {
                let list = self.store.list(self.kind, &ListParams::all()).await?;
                self.last = Some(list.resource_version);
                return Ok(WatchChange::Listed(list.items));
            };
            if self.stream.is_none() {
                match self.store.watch(self.kind, &since).await {
                    Ok(s) => self.stream = Some(s),
                    Err(StoreError::Expired { .. }) => {
                        self.expired();
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let next = match self.stream.as_mut() {
                Some(s) => s.next().await,
                None => continue,
            };
            match next {
                Some(Ok(ev)) => {
                    self.last = Some(ev.resource_version());
                    return Ok(WatchChange::Event(ev));
                }
                Some(Err(StoreError::Expired { .. })) => self.expired(),
                Some(Err(e)) => {
                    self.stream = None;
                    return Err(e);
                }
                // The watch ended (a server closes watches now and then): resume.
                None => self.stream = None,
            }
        }
    }

    fn expired(&mut self) {
        self.relists += 1;
        self.last = None;
        self.stream = None;
    }
}
