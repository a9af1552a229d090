//! The block-device view every frontend has of a volume.
//!
//! Frontends (iSCSI, NBD) see the replicator only through [`BlockDevice`]. [`MemDevice`]
//! and [`FileDevice`] are simple implementations for frontend tests and benchmarks against a
//! plain file.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

/// Errors a block device returns to a frontend.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("range {offset}+{length} is outside the device of {size} bytes")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("I/O error: {0}")]
    Io(String),
    #[error("no space left: {0}")]
    NoSpace(String),
    /// The volume has no replica able to serve (faulted).
    #[error("volume unavailable: {0}")]
    Unavailable(String),
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A volume as frontends see it. Offsets and lengths are in bytes; implementations accept
/// any alignment but are fastest at multiples of 4096.
pub trait BlockDevice: Send + Sync + 'static {
    fn size(&self) -> u64;
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>>;
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>>;
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>>;
    /// Makes every write acknowledged before it durable.
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>>;
}
