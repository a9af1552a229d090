//! An engine for an operation that needs one, whether or not the volume is attached.
//!
//! Snapshots, their deletion and expansion are done by a volume's engine: it is the only
//! process that knows which replicas are current, so nothing else may change their layer
//! chains. An attached volume has one running. A detached volume (a CSI volume before its
//! pod starts, a `VolumeSnapshot` of a PVC no pod uses) gets one for the call: the
//! operation attaches it without a frontend, marked with the [`MAINTENANCE_ANNOTATION`]
//! (`<operation>:<token>`), waits for the engine, runs the call and detaches again whether
//! it worked or not — the same protocol as a revert of a detached volume (see
//! `snapshot.rs`). No client can reach the volume meanwhile (there is no frontend), and an
//! attach that wants a frontend is refused until the annotation is gone, so the call never
//! races a writer.
//!
//! Two such calls on one detached volume at once: the second finds it attached and is
//! answered [`OpsError::Aborted`] ("try again"), which the CSI sidecars do.

use zebu_types::names::MAINTENANCE_ANNOTATION;
use zebu_types::resources::Engine;
use zebu_types::store::TypedStore;

use crate::populate::Population;
use crate::{Ops, OpsError, OpsResult};

/// How long an operation on a detached volume waits for the engine of a detach under way.
const DETACH_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
const DETACH_POLL: std::time::Duration = std::time::Duration::from_millis(100);

impl Ops {
    /// Run `op` with the control address of an engine of `volume`: its running engine when
    /// attached, or one started without a frontend for the call when detached (see the
    /// module docs). `what` names the operation in the annotation and the logs.
    pub(crate) async fn with_engine<T, F, Fut>(
        &self,
        volume: &str,
        what: &str,
        op: F,
    ) -> OpsResult<T>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = OpsResult<T>>,
    {
        let v = self.get_volume(volume).await?;
        crate::standby::refuse_standby(&v, "get an engine for a call")?;
        if v.metadata.is_deleting() {
            return Err(OpsError::precondition(
                volume,
                format!("volume {volume:?} is being deleted"),
            ));
        }
        if let Some(p) = Population::of(&v)
            && !p.is_done()
        {
            return Err(OpsError::aborted(format!(
                "volume {volume:?} is being filled from its data source ({p}); try again when that is done"
            )));
        }
        if v.spec.node_id.is_some() {
            let engine = self.running_engine(volume).await?;
            return match engine.and_then(|e| e.status.control_address) {
                Some(control) => op(control).await,
                None => Err(OpsError::aborted(format!(
                    "volume {volume:?} is attaching or detaching: its engine is not running yet; try again"
                ))),
            };
        }
        self.with_detached_engine(volume, what, op).await
    }

    async fn with_detached_engine<T, F, Fut>(&self, volume: &str, what: &str, op: F) -> OpsResult<T>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = OpsResult<T>>,
    {
        // The engine of a detach that just happened (often the previous maintenance call's
        // own) goes within a second or two: wait that long rather than make every caller
        // retry back-to-back calls on a detached volume.
        let deadline = tokio::time::Instant::now() + DETACH_WAIT;
        loop {
            let still_there = self
                .store
                .list_as::<Engine>()
                .await?
                .into_iter()
                .any(|e| e.spec.volume == volume);
            if !still_there {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(OpsError::aborted(format!(
                    "volume {volume:?} is still detaching; try again when it is detached"
                )));
            }
            tokio::time::sleep(DETACH_POLL).await;
        }
        let token = format!("{what}:{:08x}", rand::random::<u32>());
        let node = self.claim_maintenance(volume, &token).await?;
        tracing::info!(volume, node = %node, what, "attached without a frontend for an operation");
        let result = match self.wait_maintenance_engine(volume).await {
            Ok(engine) => {
                let control = engine.status.control_address.unwrap_or_default();
                op(control).await
            }
            Err(e) => Err(e),
        };
        self.release_maintenance(volume, &token, what).await;
        result
    }

    /// Attach the detached `volume` without a frontend on a node picked for it, marked with
    /// `token` in the [`MAINTENANCE_ANNOTATION`]; the node's name. Refused ("try again") when
    /// someone attached it meanwhile.
    pub(crate) async fn claim_maintenance(&self, volume: &str, token: &str) -> OpsResult<String> {
        let node = self.pick_node(volume).await?;
        self.edit_volume(volume, |v| {
            if v.spec.node_id.is_some() {
                return Err(OpsError::aborted(format!(
                    "volume {volume:?} was attached meanwhile; try again"
                )));
            }
            v.spec.node_id = Some(node.clone());
            v.spec.disable_frontend = true;
            v.metadata
                .annotations
                .insert(MAINTENANCE_ANNOTATION.into(), token.to_string());
            Ok(())
        })
        .await?;
        Ok(node)
    }

    /// Detach again after an operation, whether it worked or not, unless someone else took
    /// the volume over meanwhile (the annotation no longer holds `token`). A failure is
    /// logged: the volume then stays attached without a frontend, annotated with why, and
    /// `zebu volume detach` ends it.
    pub(crate) async fn release_maintenance(&self, volume: &str, token: &str, what: &str) {
        let released = self
            .edit_volume(volume, |v| {
                if v.metadata
                    .annotations
                    .get(MAINTENANCE_ANNOTATION)
                    .map(String::as_str)
                    == Some(token)
                {
                    v.spec.node_id = None;
                    v.spec.disable_frontend = false;
                    v.metadata.annotations.remove(MAINTENANCE_ANNOTATION);
                }
                Ok(())
            })
            .await;
        if let Err(e) = released {
            tracing::warn!(volume, what, "could not detach after the operation: {e}");
        }
    }
}
