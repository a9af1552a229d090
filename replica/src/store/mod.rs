//! The on-disk replica: a live head file plus a chain of read-only snapshot files.
//! (API contract; implementation in progress.)

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use crate::error::Result;
use crate::io::IoEngine;

/// Block size of the data path; I/O not aligned to it is read-modify-write.
pub const BLOCK_SIZE: u64 = 4096;

/// One layer as [`Replica::info`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    pub id: u64,
    /// Snapshot name; empty for the head.
    pub name: String,
    /// Parent layer id, 0 for none.
    pub parent: u64,
    pub head: bool,
    pub user_created: bool,
    pub data_bytes: u64,
    /// RFC 3339.
    pub created: String,
    pub labels: BTreeMap<String, String>,
    pub size: u64,
}

/// A snapshot of a replica's state for `Info`.
#[derive(Debug, Clone)]
pub struct ReplicaInfo {
    pub replica_id: String,
    pub size: u64,
    pub generation: u64,
    pub epoch: u64,
    pub epoch_members: Vec<String>,
    pub flush_number: u64,
    /// The head's chain from the oldest layer to the head, then layers off the chain.
    pub layers: Vec<LayerInfo>,
    pub region_size: u64,
    pub region_count: u64,
    /// Regions written since the last flush.
    pub dirty_regions: Vec<u64>,
}

/// How a layer written by a rebuild ([`Replica::write_layer`]) is described.
#[derive(Debug, Clone, Default)]
pub struct LayerSpec {
    pub name: String,
    /// Parent snapshot name; empty for none.
    pub parent: String,
    pub user_created: bool,
    pub created: String,
    pub labels: BTreeMap<String, String>,
    pub size: u64,
}

/// One open replica. All methods take `&self`; it is shared behind an `Arc`.
pub struct Replica {
    _io: IoEngine,
}

impl Replica {
    /// Creates a replica of `size` bytes in `dir` (made if missing; must be empty).
    pub async fn create(_dir: &Path, _size: u64, _io: IoEngine) -> Result<Arc<Replica>> {
        todo!()
    }
    /// Opens the replica in `dir`, repairing what a crash left half done.
    pub async fn open(_dir: &Path, _io: IoEngine) -> Result<Arc<Replica>> {
        todo!()
    }
    /// Opens `dir`, or creates a replica of `size` there when `dir` is missing or empty.
    /// Fails with `SizeMismatch` when it holds a replica of another size, and `NotAReplica`
    /// when it holds something else.
    pub async fn open_or_create(_dir: &Path, _size: u64, _io: IoEngine) -> Result<Arc<Replica>> {
        todo!()
    }
    pub fn size(&self) -> u64 {
        todo!()
    }
    /// Reads `len` bytes at `offset`, resolved through the chain (zeros where no layer has
    /// data). Any alignment; `len` > 0 and within the volume.
    pub async fn read(&self, _offset: u64, _len: u64) -> Result<Bytes> {
        todo!()
    }
    /// Writes `data` at `offset` into the head. Any alignment; unaligned is read-modify-write.
    pub async fn write(&self, _offset: u64, _data: Bytes) -> Result<()> {
        todo!()
    }
    /// Makes the range read as zeros, freeing space in the head.
    pub async fn unmap(&self, _offset: u64, _len: u64) -> Result<()> {
        todo!()
    }
    /// Makes every completed write durable; returns the flush number now durable.
    /// `flush_number` 0 means "my own number + 1".
    pub async fn flush(&self, _flush_number: u64) -> Result<u64> {
        todo!()
    }
    pub async fn snapshot_create(
        &self,
        _name: &str,
        _user_created: bool,
        _labels: BTreeMap<String, String>,
    ) -> Result<()> {
        todo!()
    }
    pub async fn snapshot_delete(&self, _name: &str) -> Result<()> {
        todo!()
    }
    pub async fn snapshot_revert(&self, _name: &str) -> Result<()> {
        todo!()
    }
    pub async fn snapshot_purge(&self) -> Result<()> {
        todo!()
    }
    pub async fn expand(&self, _new_size: u64) -> Result<()> {
        todo!()
    }
    /// Accepts an engine's generation: an error if lower than the highest accepted; a higher
    /// one is persisted before this returns.
    pub async fn accept_generation(&self, _generation: u64) -> Result<()> {
        todo!()
    }
    pub async fn set_epoch(&self, _epoch: u64, _members: Vec<String>) -> Result<()> {
        todo!()
    }
    pub fn info(&self) -> ReplicaInfo {
        todo!()
    }
    /// Data extents of a layer (`None` = head) within `range`, in bytes.
    pub async fn list_extents(
        &self,
        _layer: Option<&str>,
        _range: Range<u64>,
    ) -> Result<Vec<Range<u64>>> {
        todo!()
    }
    /// Raw bytes of one layer (zeros in its holes), not resolved through the chain.
    pub async fn read_layer(&self, _layer: Option<&str>, _offset: u64, _len: u64) -> Result<Bytes> {
        todo!()
    }
    /// Ensures the layer described by `spec` exists (see `WriteLayerRequest` in the proto).
    pub async fn begin_layer(&self, _spec: &LayerSpec) -> Result<()> {
        todo!()
    }
    /// Writes rebuild data into snapshot `name` (created by `begin_layer`).
    pub async fn write_layer(&self, _name: &str, _offset: u64, _data: Bytes) -> Result<()> {
        todo!()
    }
    /// Makes a rebuilt layer durable.
    pub async fn finish_layer(&self, _name: &str) -> Result<()> {
        todo!()
    }
    /// Flushes and closes; every later call fails with `Closed`.
    pub async fn close(&self) -> Result<()> {
        todo!()
    }
}
