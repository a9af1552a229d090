//! One copy of a Zebu volume: sparse layer files with a snapshot chain, and the gRPC server
//! that lets an engine use them.
//!
//! - [`store::Replica`]: the on-disk replica. A live head file plus read-only snapshot files,
//!   `replica.json` as the single commit point of every structural change, and `regions.dat`,
//!   the per-region flush record the engine reconciles with. Extent-map indexes in memory.
//! - [`io`]: reads, writes and syncs of layer files over io_uring (several rings) or a thread
//!   pool, with `O_DIRECT` where the filesystem allows it.
//! - [`pathtime`]: counters of where a write's and a flush's time goes, per step.
//! - [`server`]: the `zebu.replica.v1` gRPC service (data stream with generation fencing,
//!   control, catch-up and sync RPCs); `zebu-replica serve|info` is the binary around it.
//!
//! ```no_run
//! # async fn demo() -> zebu_replica::Result<()> {
//! use zebu_replica::io::{BackendKind, IoEngine};
//! let io = IoEngine::new(BackendKind::Auto).expect("io engine");
//! let r = zebu_replica::Replica::open_or_create("/var/lib/zebu/r1".as_ref(), 1 << 30, io).await?;
//! r.write(0, bytes::Bytes::from(vec![7u8; 4096])).await?;
//! r.flush(0).await?;
//! assert_eq!(r.read(0, 4096).await?[0], 7);
//! # Ok(()) }
//! ```

pub mod error;
pub mod io;
pub mod pathtime;
pub mod server;
pub mod store;

pub use error::{ReplicaError, Result};
pub use store::{BLOCK_SIZE, LayerInfo, LayerSpec, Replica, ReplicaInfo};

// Offsets are u64 and buffers usize everywhere; they convert losslessly only on 64-bit.
const _: () = assert!(usize::BITS == 64, "Zebu supports 64-bit targets only");
