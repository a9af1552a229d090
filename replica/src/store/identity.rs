//! Which volume a replica belongs to, and the bounds on what engines send it: counters
//! (generation, epoch, flush number; `numbers.rs` in proto) and layer ranges.
//!
//! `replica.json` records the volume's uuid (`Meta::volume_uuid`). An engine names its
//! volume in every data-stream hello ([`VolumeClaim`]); [`Replica::claim_volume`] decides
//! before anything else of the hello is looked at, so a replica of another volume is never
//! fenced, caught up or written by a stranger:
//!
//! | replica records | hello names        | result                                            |
//! |-----------------|--------------------|---------------------------------------------------|
//! | uuid `u`        | `u`                | accepted                                          |
//! | uuid `u`        | `v` ≠ `u`, or none | refused, naming both                              |
//! | none            | none               | accepted (an engine and replica from before identity) |
//! | none            | `v`, fresh replica | `v` recorded durably, accepted                    |
//! | none            | `v` with adopt     | `v` recorded durably, accepted (upgrade path)     |
//! | none            | `v`, not fresh     | refused: only a member's engine may adopt it      |
//!
//! Fresh means never a member of an epoch (epoch 0, no members): it holds no volume's data
//! that an engine could trust. An engine sets adopt only for replicas it lists as current
//! members at its start, which is how replicas made before volume identity get one: at the
//! first start of an engine of this build. A pre-identity replica that is *not* current then
//! (it was out of the volume) is refused for catch-up and rebuild and needs a fresh
//! directory: nothing shows which volume its data is of.

use zebu_proto::frames::VolumeClaim;
use zebu_proto::numbers::{Epoch, FlushNumber, Generation};

use super::{LayerId, Replica};
use crate::error::{ReplicaError, Result};

impl Replica {
    /// The uuid of the volume this replica belongs to, if it has one yet.
    pub fn volume_uuid(&self) -> Option<String> {
        self.meta().volume_uuid.clone()
    }

    /// Checks (and, for a replica without one, maybe records) the volume a client names;
    /// see the module docs for the table.
    pub async fn claim_volume(&self, claim: Option<&VolumeClaim>) -> Result<()> {
        if self.decide_claim(claim)? {
            return Ok(());
        }
        let claim = claim.expect("invariant: only a claim is ever recorded");
        let _ops = self.ops.lock().await;
        self.check_open()?;
        // Decided again under `ops`: another hello may have recorded a uuid meanwhile.
        if self.decide_claim(Some(claim))? {
            return Ok(());
        }
        let uuid = claim.uuid.clone();
        self.commit_meta(|m| {
            m.volume_uuid = Some(uuid);
            Ok(())
        })
        .await?;
        tracing::info!(volume_uuid = %claim.uuid, adopt = claim.adopt, "replica now belongs to volume {}", claim.uuid);
        Ok(())
    }

    /// Checks `offset+len` against the size of layer `id` (which may be smaller than the
    /// volume's, for a snapshot taken before an expand), without overflowing.
    pub(super) fn check_layer_range(&self, id: LayerId, offset: u64, len: u64) -> Result<()> {
        let size = self.meta().layer(id).map_or(0, |l| l.size);
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(ReplicaError::OutOfRange {
                offset,
                length: len,
                size,
            }),
        }
    }

    /// `Ok(true)`: accepted as it is; `Ok(false)`: the claim is to be recorded.
    fn decide_claim(&self, claim: Option<&VolumeClaim>) -> Result<bool> {
        let m = self.meta();
        match (&m.volume_uuid, claim) {
            (Some(has), Some(c)) if *has == c.uuid => Ok(true),
            (Some(has), c) => Err(ReplicaError::WrongVolume {
                replica: m.replica_id.clone(),
                has: has.clone(),
                offered: c.map_or_else(|| "(none named in the hello)".into(), |c| c.uuid.clone()),
            }),
            (None, None) => Ok(true),
            (None, Some(c)) => {
                let fresh = m.epoch == 0 && m.epoch_members.is_empty();
                if fresh || c.adopt {
                    Ok(false)
                } else {
                    Err(ReplicaError::UnclaimedVolume {
                        replica: m.replica_id.clone(),
                        epoch: m.epoch,
                        offered: c.uuid.clone(),
                    })
                }
            }
        }
    }
}

/// A generation an engine offers, checked against the accepted one (`numbers.rs` in proto).
pub(super) fn check_generation(accepted: u64, offered: u64) -> Result<()> {
    Generation(accepted)
        .accepts(Generation(offered))
        .map_err(|e| ReplicaError::Invalid(e.to_string()))
}

/// An epoch an engine records, checked against the recorded one.
pub(super) fn check_epoch(current: u64, offered: u64) -> Result<()> {
    Epoch(current)
        .accepts(Epoch(offered))
        .map_err(|e| ReplicaError::Invalid(e.to_string()))
}

/// A flush number an engine asks for, checked against the durable one.
pub(super) fn check_flush_number(durable: u64, offered: u64) -> Result<()> {
    FlushNumber(durable)
        .accepts(FlushNumber(offered))
        .map_err(|e| ReplicaError::Invalid(e.to_string()))
}
