//! From the manager's answers to CSI's: errors, volumes, snapshots, page tokens, sizes.

use std::collections::HashMap;

use tonic::{Code, Status};
use zebu_manager::client::ClientError;
use zebu_proto::csi;
use zebu_types::resources::{Backup, BackupState, Robustness, Snapshot, Volume, VolumeState};

use crate::node::attach::{CTX_FRONTEND, CTX_IQN, CTX_LUN, CTX_NBD_URI, CTX_PORTAL};
use crate::params::{CTX_FS_TYPE, CTX_MKFS_PARAMS};

/// Volume annotations that carry the resolved StorageClass parameters into the volume
/// context of later calls (ListVolumes, ControllerGetVolume).
pub const FS_TYPE_ANNOTATION: &str = "csi.zebu.io/fsType";
pub const MKFS_PARAMS_ANNOTATION: &str = "csi.zebu.io/mkfsParams";

/// The default size of a volume whose request names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// Zebu volumes are whole 4 KiB blocks.
const BLOCK: u64 = 4096;

fn code_named(name: &str) -> Option<Code> {
    Some(match name {
        "InvalidArgument" => Code::InvalidArgument,
        "NotFound" => Code::NotFound,
        "AlreadyExists" => Code::AlreadyExists,
        "FailedPrecondition" => Code::FailedPrecondition,
        "Aborted" => Code::Aborted,
        "OutOfRange" => Code::OutOfRange,
        "DeadlineExceeded" => Code::DeadlineExceeded,
        "Unavailable" => Code::Unavailable,
        "PermissionDenied" => Code::PermissionDenied,
        "ResourceExhausted" => Code::ResourceExhausted,
        "Internal" => Code::Internal,
        _ => return None,
    })
}

/// A manager error as the CSI call's answer: the code the operation meant (the API says
/// it), else one from the HTTP status; an unreachable manager is Unavailable, so the
/// sidecars retry.
pub fn api_status(e: ClientError) -> Status {
    match e {
        ClientError::Api {
            status,
            message,
            code,
        } => {
            let c = code
                .as_deref()
                .and_then(code_named)
                .unwrap_or(match status.as_u16() {
                    400 => Code::InvalidArgument,
                    404 => Code::NotFound,
                    409 => Code::FailedPrecondition,
                    403 => Code::PermissionDenied,
                    503 | 502 => Code::Unavailable,
                    504 => Code::DeadlineExceeded,
                    _ => Code::Internal,
                });
            Status::new(c, message)
        }
        e @ (ClientError::Connect { .. } | ClientError::Http { .. }) => {
            Status::unavailable(e.to_string())
        }
        e @ (ClientError::BadAddress { .. } | ClientError::Invalid { .. }) => {
            Status::internal(e.to_string())
        }
    }
}

/// The size to create for a capacity range: the required bytes rounded up to 4 KiB (the
/// default when none), within the limit.
pub fn size_for(range: Option<&csi::CapacityRange>) -> Result<u64, Status> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(Status::invalid_argument(
            "capacity_range: required_bytes and limit_bytes must not be negative",
        ));
    }
    let (required, limit) = (required.cast_unsigned(), limit.cast_unsigned());
    if limit > 0 && required > limit {
        return Err(Status::invalid_argument(format!(
            "capacity_range: required_bytes {required} is above limit_bytes {limit}"
        )));
    }
    let size = if required == 0 {
        if limit > 0 {
            (limit - limit % BLOCK).min(DEFAULT_SIZE)
        } else {
            DEFAULT_SIZE
        }
    } else {
        required.div_ceil(BLOCK).saturating_mul(BLOCK)
    };
    if size == 0 || (limit > 0 && size > limit) {
        return Err(Status::out_of_range(format!(
            "capacity_range: Zebu volumes are whole 4 KiB blocks; none fits between {required} and {limit} bytes"
        )));
    }
    Ok(size)
}

/// Whether an existing volume of `size` satisfies a capacity range.
pub fn fits(size: u64, range: Option<&csi::CapacityRange>) -> bool {
    let Some(r) = range else { return true };
    size >= r.required_bytes.max(0).cast_unsigned()
        && (r.limit_bytes <= 0 || size <= r.limit_bytes.cast_unsigned())
}

/// The volume context a volume was created with.
pub fn volume_context(v: &Volume) -> HashMap<String, String> {
    let mut ctx = HashMap::new();
    if let Some(fs) = v.metadata.annotations.get(FS_TYPE_ANNOTATION) {
        ctx.insert(CTX_FS_TYPE.to_string(), fs.clone());
    }
    if let Some(m) = v.metadata.annotations.get(MKFS_PARAMS_ANNOTATION) {
        ctx.insert(CTX_MKFS_PARAMS.to_string(), m.clone());
    }
    ctx
}

pub fn csi_volume(v: &Volume, content_source: Option<csi::VolumeContentSource>) -> csi::Volume {
    csi::Volume {
        capacity_bytes: v.spec.size.bytes() as i64,
        volume_id: v.metadata.name.clone(),
        volume_context: volume_context(v),
        content_source,
        // Reachable from every node (a network volume): no topology constraint.
        accessible_topology: vec![],
    }
}

/// The node a volume is published to: attached with its frontend (a volume held without
/// one for a snapshot or an expansion is published nowhere).
pub fn published_node(v: &Volume) -> Option<&str> {
    if v.spec.disable_frontend {
        return None;
    }
    v.spec.node_id.as_deref()
}

/// Abnormal when degraded or faulted, with what the manager says.
pub fn condition(v: &Volume) -> csi::VolumeCondition {
    let replicas = v.status.replicas.len();
    let (abnormal, message) = match v.status.robustness {
        Robustness::Healthy => (false, format!("healthy: {replicas} replicas in sync")),
        Robustness::Degraded => (
            true,
            format!(
                "degraded: {} of {} replicas in sync{}",
                v.status
                    .replicas
                    .iter()
                    .filter(|r| r.mode == Some(zebu_types::resources::ReplicaMode::RW))
                    .count(),
                v.spec.number_of_replicas,
                v.status
                    .rebuild
                    .as_ref()
                    .map(|r| format!(
                        ", rebuilding {} ({} of {} bytes)",
                        r.replica, r.bytes_done, r.bytes_total
                    ))
                    .unwrap_or_default()
            ),
        ),
        Robustness::Faulted => (true, "faulted: no replica in sync, I/O fails".to_string()),
        Robustness::Unknown => (
            false,
            format!(
                "{}: {replicas} replicas (health is known while attached)",
                v.status.state.as_str()
            ),
        ),
    };
    csi::VolumeCondition { abnormal, message }
}

/// The publish context of an attached volume, from its endpoint
/// (`iscsi://HOST:PORT/IQN/LUN` or `nbd://HOST:PORT/NAME`).
pub fn publish_context(v: &Volume) -> Option<HashMap<String, String>> {
    if v.status.state != VolumeState::Attached {
        return None;
    }
    let endpoint = v.status.endpoint.as_deref()?;
    let (scheme, rest) = endpoint.split_once("://")?;
    let mut ctx = HashMap::new();
    match scheme {
        "iscsi" => {
            let mut parts = rest.splitn(3, '/');
            let portal = parts.next()?;
            let iqn = parts.next()?;
            let lun = parts.next().unwrap_or("1");
            ctx.insert(CTX_FRONTEND.to_string(), "iscsi".to_string());
            ctx.insert(CTX_PORTAL.to_string(), portal.to_string());
            ctx.insert(CTX_IQN.to_string(), iqn.to_string());
            ctx.insert(CTX_LUN.to_string(), lun.to_string());
        }
        "nbd" => {
            ctx.insert(CTX_FRONTEND.to_string(), "nbd".to_string());
            ctx.insert(CTX_NBD_URI.to_string(), endpoint.to_string());
        }
        _ => return None,
    }
    Some(ctx)
}

pub fn timestamp(rfc3339: Option<&str>) -> Option<prost_types::Timestamp> {
    let t = zebu_types::time::parse_rfc3339(rfc3339?)?;
    let d = t.duration_since(std::time::UNIX_EPOCH).ok()?;
    Some(prost_types::Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    })
}

/// A snapshot record as CSI sees it.
pub fn csi_snapshot(s: &Snapshot, snapshot_name: &str) -> csi::Snapshot {
    csi::Snapshot {
        size_bytes: s.status.volume_size.map_or(0, |b| b.bytes() as i64),
        snapshot_id: format!("{}/{snapshot_name}", s.spec.volume),
        source_volume_id: s.spec.volume.clone(),
        creation_time: timestamp(s.status.creation_time.as_deref()),
        ready_to_use: s.status.ready_to_use,
        group_snapshot_id: String::new(),
    }
}

/// A backup as CSI sees it (VolumeSnapshotClass `type: backup`): ready once its manifest is
/// committed; its size is the volume's at the snapshot (`volume_size` when the backup's
/// status has it, else the source volume's `fallback_size`); its creation time is the
/// snapshot's when recorded, else the Backup's (made right after its snapshot was taken).
pub fn csi_backup_snapshot(b: &Backup, fallback_size: u64) -> csi::Snapshot {
    let size = match b.status.volume_size.bytes() {
        0 => fallback_size,
        n => n,
    };
    let created = b
        .status
        .snapshot_created_at
        .as_deref()
        .or(b.status.backup_created_at.as_deref())
        .or(b.metadata.creation_timestamp.as_deref());
    csi::Snapshot {
        size_bytes: size as i64,
        snapshot_id: crate::names::backup_snapshot_id(&b.metadata.name),
        source_volume_id: b.spec.volume.clone(),
        creation_time: timestamp(created),
        ready_to_use: b.status.state == BackupState::Completed,
        group_snapshot_id: String::new(),
    }
}

/// Page tokens: `after:<key>` resumes after the entry with that key, so a page stays right
/// when the entry it ended on is deleted meanwhile. Anything else is not a token this
/// plugin gave (Aborted, as the spec says).
pub fn page<T>(
    items: Vec<(String, T)>,
    starting_token: &str,
    max_entries: i32,
) -> Result<(Vec<T>, String), Status> {
    if max_entries < 0 {
        return Err(Status::invalid_argument("max_entries must not be negative"));
    }
    let after = if starting_token.is_empty() {
        None
    } else {
        Some(
            starting_token
                .strip_prefix("after:")
                .filter(|k| !k.is_empty())
                .ok_or_else(|| {
                    Status::aborted(format!(
                        "starting_token {starting_token:?} was not given by this plugin"
                    ))
                })?,
        )
    };
    let mut items = items;
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rest: Vec<(String, T)> = items
        .into_iter()
        .filter(|(k, _)| after.is_none_or(|a| k.as_str() > a))
        .collect();
    let limit = match usize::try_from(max_entries) {
        Ok(0) | Err(_) => rest.len(),
        Ok(n) => n,
    };
    let more = rest.len() > limit;
    rest.truncate(limit);
    let next = if more {
        rest.last()
            .map(|(k, _)| format!("after:{k}"))
            .unwrap_or_default()
    } else {
        String::new()
    };
    Ok((rest.into_iter().map(|(_, v)| v).collect(), next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_blocks_within_the_limit() {
        let r = |required, limit| csi::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        };
        assert_eq!(size_for(None).expect("default"), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&r(1, 0))).expect("tiny"), 4096);
        assert_eq!(size_for(Some(&r(4097, 0))).expect("up"), 8192);
        assert_eq!(size_for(Some(&r(0, 10_000))).expect("limit"), 8192);
        assert_eq!(
            size_for(Some(&r(4097, 5000)))
                .expect_err("no block fits")
                .code(),
            Code::OutOfRange
        );
        assert_eq!(
            size_for(Some(&r(-1, 0))).expect_err("negative").code(),
            Code::InvalidArgument
        );
        assert!(fits(8192, Some(&r(4097, 0))));
        assert!(!fits(4096, Some(&r(4097, 0))));
    }

    #[test]
    fn pages_resume_after_the_last_entry_even_when_it_is_gone() {
        let items = |names: &[&str]| {
            names
                .iter()
                .map(|n| (n.to_string(), n.to_string()))
                .collect::<Vec<_>>()
        };
        let (p1, t1) = page(items(&["c", "a", "b", "d"]), "", 2).expect("first");
        assert_eq!(p1, ["a", "b"]);
        assert_eq!(t1, "after:b");
        // "b" was deleted meanwhile.
        let (p2, t2) = page(items(&["a", "c", "d"]), &t1, 2).expect("second");
        assert_eq!(p2, ["c", "d"]);
        assert_eq!(t2, "");
        assert_eq!(
            page(items(&["a"]), "invalid-token", 0)
                .expect_err("bad")
                .code(),
            Code::Aborted
        );
        assert_eq!(
            page(items(&["a"]), "", -1).expect_err("neg").code(),
            Code::InvalidArgument
        );
    }

    #[test]
    fn endpoints_become_publish_contexts() {
        let mut v = Volume::new(
            "v",
            serde_json::from_value(serde_json::json!({"size": 4096, "numberOfReplicas": 3}))
                .expect("spec"),
        );
        v.status.state = VolumeState::Attached;
        v.status.endpoint = Some("iscsi://127.0.0.11:3260/iqn.2025-01.io.zebu:v/1".into());
        let ctx = publish_context(&v).expect("iscsi");
        assert_eq!(ctx["portal"], "127.0.0.11:3260");
        assert_eq!(ctx["iqn"], "iqn.2025-01.io.zebu:v");
        assert_eq!(ctx["lun"], "1");
        v.status.endpoint = Some("nbd://127.0.0.11:10809/v".into());
        assert_eq!(
            publish_context(&v).expect("nbd")["nbdUri"],
            "nbd://127.0.0.11:10809/v"
        );
        v.status.state = VolumeState::Attaching;
        assert_eq!(publish_context(&v), None);
    }
}
