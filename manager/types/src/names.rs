//! Names of finalizers, labels and annotations: one place, so every writer and every reader
//! (controllers, agents, ops, a Kubernetes store, `kubectl -l`) agree on them.
//!
//! Label *values* must be valid Kubernetes label values (at most 63 of `A-Za-z0-9-_.`), so
//! anything else (a time, a free-form reason) goes in an annotation.

/// Held by every Volume until its engine and replicas are gone (the volume controller).
pub const VOLUME_FINALIZER: &str = "zebu.io/volume-controller";
/// Held by every Replica until its node agent stopped its process and removed its files.
pub const REPLICA_FINALIZER: &str = "zebu.io/replica-cleanup";
/// Held by every Engine until its node agent stopped its process.
pub const ENGINE_FINALIZER: &str = "zebu.io/engine-stop";

/// On Replica, Engine, Snapshot and Backup objects: the volume they belong to, so
/// `kubectl get zr -l zebu.io/volume=db` and a store's label selector find them.
pub const VOLUME_LABEL: &str = "zebu.io/volume";
/// On Replica and Engine objects: the node whose agent runs their process.
pub const NODE_LABEL: &str = "zebu.io/node";
/// On a Replica whose node stayed down longer than the volume's `staleReplicaTimeout`:
/// value `"true"`; it no longer counts, and goes once its replacement is in sync, even if
/// its node comes back meanwhile. When it was marked is in [`SUPERSEDED_AT_ANNOTATION`].
/// (Older stores carry a timestamp as the value; any value counts.)
pub const SUPERSEDED_LABEL: &str = "zebu.io/superseded";
/// When a replica was superseded (RFC 3339).
pub const SUPERSEDED_AT_ANNOTATION: &str = "zebu.io/superseded-at";

/// On a Volume attached with its frontend disabled by an operation (a snapshot revert of a
/// detached volume): what holds it, `revert:<snapshot>:<token>`. The operation detaches the
/// volume when done, but only while this still names it.
pub const MAINTENANCE_ANNOTATION: &str = "zebu.io/maintenance";

/// The well-known Kubernetes label a node's zone is read from.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The Engine object of a volume (a volume has at most one).
pub fn engine_name(volume: &str) -> String {
    format!("{volume}-e")
}

/// Replica directories live in this directory of a node's disk: `<disk>/replicas/<replica>`.
pub const REPLICAS_DIR: &str = "replicas";

/// Held by every Backup until its manifest is deleted from the target.
pub const BACKUP_FINALIZER: &str = "zebu.io/backup-delete";
/// On a Volume created from a backup: the Backup object it restores (set at creation).
pub const FROM_BACKUP_ANNOTATION: &str = "zebu.io/from-backup";
/// On a standby volume: the source volume whose backups it follows until activated.
pub const STANDBY_FROM_ANNOTATION: &str = "zebu.io/standby-from";
/// On a standby volume: activation was asked for (`zebu volume activate`); the standby
/// controller applies the newest backup not yet applied, then ends standby mode.
pub const STANDBY_ACTIVATE_ANNOTATION: &str = "zebu.io/standby-activate";
/// On a Volume: the deduplication family of its backups in the target, when not its own
/// name (a restored volume shares its source's family).
pub const BACKUP_FAMILY_ANNOTATION: &str = "zebu.io/backup-family";
/// On Backup objects: the RecurringJob that took it (its retention counts only these).
pub const RECURRING_JOB_LABEL: &str = "zebu.io/recurring-job";
/// The label prefix of recurring-job groups on volumes: `zebu.io/recurring-job-group.<g>`.
pub const RECURRING_GROUP_LABEL_PREFIX: &str = "zebu.io/recurring-job-group.";
