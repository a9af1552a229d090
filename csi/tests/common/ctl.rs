//! Controller calls as the CSI sidecars make them: each request built once and sent again
//! while the plugin answers Aborted ("in progress, try again"), any other error failing the
//! test. Shared by the controller, backup-snapshot and fromBackup tests.

use std::collections::HashMap;
use std::future::Future;

use tonic::transport::Channel;
use zebu_proto::csi;
use zebu_proto::csi::controller_client::ControllerClient;

use super::{mount_cap, retry_aborted};

pub type Ctl = ControllerClient<Channel>;

/// A CreateVolume request for `name` with the mount capability and `params`; a `required`
/// of 0 leaves the size to the plugin (a restore's source decides it).
pub fn create_req(name: &str, required: i64, params: &[(&str, &str)]) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: (required > 0).then_some(csi::CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap()],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

/// Sends `req` with `call` until the answer is not Aborted.
async fn retried<Req, T, F, Fut>(ctl: &Ctl, what: &str, req: Req, call: F) -> T
where
    Req: Clone,
    F: Fn(Ctl, Req) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    retry_aborted(what, || call(ctl.clone(), req.clone()))
        .await
        .into_inner()
}

pub async fn create(ctl: &Ctl, req: csi::CreateVolumeRequest) -> csi::Volume {
    let what = format!("CreateVolume {}", req.name);
    retried(ctl, &what, req, |mut c, r| async move {
        c.create_volume(r).await
    })
    .await
    .volume
    .expect("CreateVolume answered without a volume")
}

/// Publishes volume `id` to `node` and returns the publish context.
pub async fn publish(ctl: &Ctl, id: &str, node: &str) -> HashMap<String, String> {
    let req = csi::ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    };
    let what = format!("ControllerPublishVolume {id}");
    retried(ctl, &what, req, |mut c, r| async move {
        c.controller_publish_volume(r).await
    })
    .await
    .publish_context
}

pub async fn unpublish(ctl: &Ctl, id: &str, node: &str) {
    let req = csi::ControllerUnpublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        ..Default::default()
    };
    let what = format!("ControllerUnpublishVolume {id}");
    retried(ctl, &what, req, |mut c, r| async move {
        c.controller_unpublish_volume(r).await
    })
    .await;
}

pub async fn delete_volume(ctl: &Ctl, id: &str) {
    let req = csi::DeleteVolumeRequest {
        volume_id: id.into(),
        ..Default::default()
    };
    let what = format!("DeleteVolume {id}");
    retried(ctl, &what, req, |mut c, r| async move {
        c.delete_volume(r).await
    })
    .await;
}

pub async fn delete_snapshot(ctl: &Ctl, id: &str) {
    let req = csi::DeleteSnapshotRequest {
        snapshot_id: id.into(),
        ..Default::default()
    };
    let what = format!("DeleteSnapshot {id}");
    retried(ctl, &what, req, |mut c, r| async move {
        c.delete_snapshot(r).await
    })
    .await;
}
