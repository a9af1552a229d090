//! The Zebu volume engine: one process per volume.
//!
//! - [`replicator::Volume`]: the volume over N replicas (RW/WO/ERR modes, epochs recorded
//!   before acknowledgements, ordered overlapping writes, start-time salvage and reconcile,
//!   catch-up and full rebuild, snapshots). It implements [`blockdev::BlockDevice`], which is
//!   all a frontend sees of a volume.
//! - Frontends: [`iscsi`] (RFC 7143 target, SBC-3 commands) and [`nbd`] (newstyle fixed
//!   handshake); both can serve the same volume at once.
//! - [`control`]: the `zebu.engine.v1` gRPC control API the manager and the CLI use.
//!
//! Test tooling (the verified workload, `zebu-verify`, the fuzz harnesses) lives in the
//! `zebu-testkit` crate, so none of it ships in this library.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use zebu_engine::blockdev::BlockDevice;
//! use zebu_engine::replicator::{StartOptions, Volume, VolumeConfig};
//! let config = VolumeConfig { name: "vol".into(), size: 1 << 30, io_timeout: Duration::from_secs(5),
//!     local_hosts: vec![], data_transport: Default::default(), checksums: true };
//! let replicas = vec!["127.0.0.11:9501".into(), "127.0.0.12:9501".into()];
//! let (volume, _stale) = Volume::start(StartOptions { config, replicas, salvage: false }).await?;
//! volume.write(0, bytes::Bytes::from(vec![1u8; 4096])).await?;
//! volume.flush().await?;
//! # Ok(()) }
//! ```

pub mod blockdev;
pub mod busypoll;
pub mod cli_args;
pub mod control;
pub mod heap;
pub mod iscsi;
pub mod nbd;
pub mod pathtime;
pub mod replicator;
mod sockio;

// Offsets are u64 and buffers usize everywhere; they convert losslessly only on 64-bit.
const _: () = assert!(usize::BITS == 64, "Zebu supports 64-bit targets only");
