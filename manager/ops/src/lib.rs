//! `zebu-ops`: the rules of every user operation, in one place, for every caller.
//!
//! [`Ops`] holds a store (any backend, as `Arc<dyn Store>`) and carries out what a person or
//! a CSI plugin asks: create (empty, from a snapshot, or as a clone), get, watch, attach
//! (with a chosen frontend), detach, expand (online, or offline through an engine started
//! for it) and delete volumes; list, create, delete and revert snapshots (of detached
//! volumes too, through an engine started for the call); start, stop and watch scrubs of
//! attached volumes ([`scrub`]); report capacity per node or zone. The REST API, the
//! `zebu` CLI (through the API) and the CSI plugin (through the API) call it; none of them
//! has rules of its own. [`populate`] fills new volumes from snapshots.
//!
//! Each operation checks its request (names are DNS-1123 labels, sizes whole 4 KiB blocks,
//! a volume no one can place is refused at once with the scheduler's reason), then writes the
//! volume's `spec` through the store with a resourceVersion check; the controllers make it so
//! and write `status`. Operations that act on a volume's data (snapshots, expansion) ask its
//! running engine through [`engine_rpc`], the one module of the manager that talks to
//! engines. Errors are [`OpsError`]s, which map to HTTP statuses and gRPC codes.
//!
//! [`scheduler`] (a pure function from the cluster's state to replica placements) lives here
//! because create refuses what can never be placed; the volume controller uses it too.
//!
//! ```no_run
//! # async fn demo(store: std::sync::Arc<dyn zebu_types::Store>) -> Result<(), zebu_ops::OpsError> {
//! use zebu_ops::Ops;
//! use zebu_types::requests::{AttachVolume, CreateVolume};
//! let ops = Ops::new(store);
//! ops.create_volume(CreateVolume::new("db", "10G".parse().expect("size"))).await?;
//! ops.attach_volume("db", AttachVolume::default()).await?;
//! # Ok(()) }
//! ```

pub mod backup;
mod capacity;
pub mod engine_rpc;
mod error;
mod maintenance;
pub mod populate;
pub mod recurring;
pub mod scheduler;
pub mod scrub;
mod snapshot;
pub mod standby;
mod volume;

use std::sync::Arc;

use zebu_types::Store;

pub use capacity::CapacityScope;
pub use error::{OpsError, OpsResult};
pub use populate::{DATA_SOURCE_ANNOTATION, POPULATION_ANNOTATION, Population};
pub use snapshot::{SNAPSHOT_NAME_ANNOTATION, snapshot_record_name};
pub use volume::{MAX_REPLICAS, VOLUME_ALIGNMENT, VolumeChange};

/// The operations over one store; cheap to clone.
#[derive(Clone)]
pub struct Ops {
    store: Arc<dyn Store>,
    /// The copies into new volumes this process runs (see [`populate`]).
    copies: populate::Copies,
    /// When the cluster's replica ports speak TLS: the CA their certificates are checked
    /// against, for the replica clients of [`populate`].
    replica_tls: Option<zebu_proto::tls::TlsConnector>,
}

impl Ops {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Ops {
            store,
            copies: populate::Copies::default(),
            replica_tls: None,
        }
    }

    /// Connect to replicas over TLS, trusting what `tls` trusts (the cluster's replica CA).
    pub fn with_replica_tls(mut self, tls: Option<zebu_proto::tls::TlsConnector>) -> Self {
        self.replica_tls = tls;
        self
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }
}
