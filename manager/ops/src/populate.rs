//! Filling a new volume with a snapshot's data: volumes created from a snapshot, and clones
//! (a snapshot of the source taken for the clone, then the same).
//!
//! **How the data moves.** A snapshot is a chain of immutable layers on each replica of the
//! source (the snapshot's layer and its ancestors). The copy reads that chain from one
//! source replica with the replica sync RPCs (`ListExtents` is implied by `ReadLayer`, which
//! streams only the layer's data extents) and writes each layer into every replica of the
//! new volume with `WriteLayer`, oldest first, exactly as a rebuild copies a replica. So:
//!
//! - holes are never read or sent: the cost is the snapshot's allocated bytes, not the
//!   volume's size;
//! - each byte is read once from the source and sent to every new replica at once (one
//!   `ReadLayer` stream, one `WriteLayer` stream per target), instead of being written once
//!   and then rebuilt replica by replica;
//! - no engine is involved on either side: the source's layers are immutable (a snapshot
//!   is never written again), and the new volume has no engine until the copy is done, so
//!   no client can see a half-filled volume.
//!
//! The other way — through the engines, reading the source's frontend and writing the new
//! volume's — would read every hole as zeros, send everything twice over the network and
//! need both volumes attached.
//!
//! **Which source replica.** Any running replica of the source whose chain holds the
//! snapshot with every layer complete: a snapshot's layers never change, and a replica that
//! missed writes before the snapshot was taken cannot hold it (the engine takes snapshots
//! on RW replicas only; a rebuild copies complete layers).
//!
//! **State, and what a crash leaves.** The volume carries its source in
//! [`DATA_SOURCE_ANNOTATION`] (`<volume>/<snapshot>`) and the copy's state in
//! [`POPULATION_ANNOTATION`] ([`Population`]), written before the copy starts and when it
//! ends. Attach refuses a volume whose copy is not done. The copy runs in the manager that
//! created the volume; if that manager stops, the state stays `copying`, and
//! [`Ops::ensure_populated`] (which the CSI plugin calls on every retry of CreateVolume)
//! starts it again. Writing a layer again is allowed (`WriteLayer` accepts identical data
//! twice), and layers a target already has complete are skipped, so a restarted copy
//! finishes what the first began.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use zebu_proto::replica as pb;
use zebu_proto::replica::replica_client::ReplicaClient;
use zebu_types::resources::{Replica, ReplicaState, Volume};
use zebu_types::store::TypedStore;

use crate::{Ops, OpsError, OpsResult};

/// On a Volume made from another's data: `<volume>/<snapshot>`.
pub const DATA_SOURCE_ANNOTATION: &str = "zebu.io/data-source";
/// On such a Volume: the copy's state, as [`Population`] writes it.
pub const POPULATION_ANNOTATION: &str = "zebu.io/population";

/// How long a copy waits for the new volume's replicas to run.
const REPLICAS_TIMEOUT: Duration = Duration::from_secs(300);
/// A source that sends nothing for this long has stalled.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The state of a volume's copy from its data source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Population {
    Copying,
    /// Done: `bytes` of layer data copied into each replica in `millis`.
    Done {
        bytes: u64,
        millis: u64,
    },
    Failed(String),
}

impl Population {
    /// The state recorded on `v`; `None` for a volume with no data source.
    pub fn of(v: &Volume) -> Option<Population> {
        v.metadata
            .annotations
            .get(POPULATION_ANNOTATION)
            .map(|s| Population::parse(s))
    }

    pub fn is_done(&self) -> bool {
        matches!(self, Population::Done { .. })
    }

    fn parse(s: &str) -> Population {
        if s == "copying" {
            return Population::Copying;
        }
        if let Some(rest) = s.strip_prefix("done ") {
            let mut words = rest.split(' ');
            let bytes = words.next().and_then(|w| w.parse().ok());
            let millis = words.nth(2).and_then(|w| w.parse().ok());
            if let (Some(bytes), Some(millis)) = (bytes, millis) {
                return Population::Done { bytes, millis };
            }
        }
        Population::Failed(s.strip_prefix("failed: ").unwrap_or(s).to_string())
    }
}

/// The annotation's text: `copying`, `done <bytes> bytes in <ms> ms`, `failed: <why>`.
impl fmt::Display for Population {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Population::Copying => f.write_str("copying"),
            Population::Done { bytes, millis } => write!(f, "done {bytes} bytes in {millis} ms"),
            Population::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// The copies this manager process runs, by target volume.
#[derive(Debug, Clone, Default)]
pub(crate) struct Copies(Arc<Mutex<BTreeSet<String>>>);

impl Copies {
    /// Claim `volume`; false if a copy into it already runs here.
    fn claim(&self, volume: &str) -> bool {
        self.0
            .lock()
            .expect("invariant: the copy set's lock is never held across a panic")
            .insert(volume.to_string())
    }

    fn release(&self, volume: &str) {
        self.0
            .lock()
            .expect("invariant: the copy set's lock is never held across a panic")
            .remove(volume);
    }
}

/// `<volume>/<snapshot>` of the annotation.
fn parse_source(s: &str) -> Option<(&str, &str)> {
    s.split_once('/')
}

impl Ops {
    /// Start the copy into `volume` unless it is done or already running in this process;
    /// the volume's state afterwards. A volume without a data source is `None`.
    pub async fn ensure_populated(&self, volume: &str) -> OpsResult<Option<Population>> {
        let v = self.get_volume(volume).await?;
        let Some(state) = Population::of(&v) else {
            return Ok(None);
        };
        if state.is_done() || v.metadata.is_deleting() {
            return Ok(Some(state));
        }
        let source = v
            .metadata
            .annotations
            .get(DATA_SOURCE_ANNOTATION)
            .and_then(|s| parse_source(s))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .ok_or_else(|| {
                OpsError::precondition(
                    volume,
                    format!("volume {volume:?} has a copy state but no valid {DATA_SOURCE_ANNOTATION} annotation"),
                )
            })?;
        if !self.copies.claim(volume) {
            return Ok(Some(state));
        }
        if matches!(state, Population::Failed(_)) {
            self.set_population(volume, &Population::Copying).await?;
        }
        let ops = self.clone();
        let target = volume.to_string();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = ops.copy_snapshot(&target, &source.0, &source.1).await;
            let state = match result {
                Ok(bytes) => {
                    let millis = started.elapsed().as_millis() as u64;
                    tracing::info!(volume = %target, source = %source.0, snapshot = %source.1, bytes, millis, "volume filled from its data source");
                    Population::Done { bytes, millis }
                }
                Err(e) => {
                    tracing::warn!(volume = %target, source = %source.0, snapshot = %source.1, "copy from the data source failed: {e}");
                    Population::Failed(e.to_string())
                }
            };
            if let Err(e) = ops.set_population(&target, &state).await {
                tracing::warn!(volume = %target, "cannot record the copy's state {state}: {e}");
            }
            ops.copies.release(&target);
        });
        Ok(Some(Population::Copying))
    }

    async fn set_population(&self, volume: &str, state: &Population) -> OpsResult<Volume> {
        let text = state.to_string();
        self.edit_volume(volume, |v| {
            v.metadata
                .annotations
                .insert(POPULATION_ANNOTATION.into(), text.clone());
            Ok(())
        })
        .await
    }

    /// The running replicas of `volume` with their addresses, once there are `count`.
    async fn running_replicas(&self, volume: &str, count: usize) -> OpsResult<Vec<String>> {
        let deadline = tokio::time::Instant::now() + REPLICAS_TIMEOUT;
        loop {
            let mine: Vec<Replica> = self
                .store
                .list_as::<Replica>()
                .await?
                .into_iter()
                .filter(|r| r.spec.volume == volume && !r.metadata.is_deleting())
                .collect();
            let running: Vec<String> = mine
                .iter()
                .filter(|r| r.status.state == ReplicaState::Running)
                .filter_map(|r| r.status.address.clone())
                .collect();
            if count > 0 && running.len() >= count {
                return Ok(running);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(OpsError::DeadlineExceeded {
                    volume: volume.to_string(),
                    message: format!(
                        "volume {volume:?}: {} of {count} replicas running after {} s",
                        running.len(),
                        REPLICAS_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Copy `snapshot` of `source` into every replica of `target`; the layer bytes copied
    /// (into each replica). See the module docs.
    async fn copy_snapshot(&self, target: &str, source: &str, snapshot: &str) -> OpsResult<u64> {
        let v = self.get_volume(target).await?;
        let targets = self
            .running_replicas(target, v.spec.number_of_replicas as usize)
            .await?;
        let sources = self.running_replicas(source, 1).await?;
        // Each volume's replicas serve only clients holding that volume's secret (issue 18).
        let source_secret = self.volume_secret(source).await?;
        let target_secret = self.volume_secret(target).await?;
        let fail = |m: String| OpsError::precondition(target, m);
        let mut chosen = None;
        let mut why = Vec::new();
        for addr in &sources {
            match replica_client(addr, source_secret.clone(), self.replica_tls.as_ref()).await {
                Ok(mut c) => match c.info(pb::InfoRequest {}).await {
                    Ok(info) => match snapshot_chain(&info.into_inner(), snapshot) {
                        Ok(chain) => {
                            chosen = Some((c, addr.clone(), chain));
                            break;
                        }
                        Err(e) => why.push(format!("{addr}: {e}")),
                    },
                    Err(s) => why.push(format!("{addr}: Info: {}", s.message())),
                },
                Err(e) => why.push(format!("{addr}: {e}")),
            }
        }
        let Some((src, src_addr, chain)) = chosen else {
            return Err(fail(format!(
                "no replica of {source:?} can provide snapshot {snapshot:?}: {}",
                why.join("; ")
            )));
        };
        let mut dsts = Vec::new();
        for addr in &targets {
            let mut c = replica_client(addr, target_secret.clone(), self.replica_tls.as_ref())
                .await
                .map_err(&fail)?;
            let info = c
                .info(pb::InfoRequest {})
                .await
                .map_err(|s| {
                    fail(format!(
                        "replica {addr} of {target:?}: Info: {}",
                        s.message()
                    ))
                })?
                .into_inner();
            dsts.push((c, addr.clone(), info));
        }
        let mut total = 0;
        let mut parent = String::new();
        for layer in &chain {
            let pending: Vec<_> = dsts
                .iter()
                .filter(|(_, _, info)| {
                    !info
                        .layers
                        .iter()
                        .any(|l| l.name == layer.name && l.rebuilt && !l.incomplete)
                })
                .map(|(c, addr, _)| (c.clone(), addr.clone()))
                .collect();
            if !pending.is_empty() {
                total += copy_layer(src.clone(), &src_addr, pending, layer, &parent)
                    .await
                    .map_err(&fail)?;
            }
            parent = layer.name.clone();
        }
        Ok(total)
    }
}

/// Adds a fresh token of the volume's secret to every call, when it has one.
#[derive(Clone)]
struct AddToken(Option<zebu_proto::auth::Secret>);

impl tonic::service::Interceptor for AddToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(secret) = &self.0 {
            let token = secret.grpc_token(zebu_proto::auth::now_secs());
            let value = token
                .parse()
                .map_err(|_| tonic::Status::internal("invariant: a hex token is ASCII"))?;
            req.metadata_mut()
                .insert(zebu_proto::auth::GRPC_AUTH_HEADER, value);
        }
        Ok(req)
    }
}

type AuthClient = ReplicaClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>,
>;

/// A client of the replica at `addr`, proving `secret` on every call, over TLS with `tls`.
async fn replica_client(
    addr: &str,
    secret: Option<zebu_proto::auth::Secret>,
    tls: Option<&zebu_proto::tls::TlsConnector>,
) -> Result<AuthClient, String> {
    let timeout = Duration::from_secs(5);
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("replica {addr}: {e}"))?
        .connect_timeout(timeout);
    let channel = tokio::time::timeout(
        timeout,
        zebu_proto::tls::grpc_channel(endpoint, addr, tls, timeout),
    )
    .await
    .map_err(|_| format!("replica {addr}: connect timed out"))?
    .map_err(|e| {
        let why = std::error::Error::source(&e).map_or_else(String::new, |s| format!(": {s}"));
        format!("replica {addr}: cannot connect: {e}{why}")
    })?;
    Ok(ReplicaClient::with_interceptor(channel, AddToken(secret))
        .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(pb::MAX_MESSAGE_BYTES))
}

/// The layers `snapshot` reads through, oldest first, if all are there and complete.
fn snapshot_chain(info: &pb::InfoResponse, snapshot: &str) -> Result<Vec<pb::LayerInfo>, String> {
    let by_id = |id: u64| info.layers.iter().find(|l| l.id == id);
    let mut layer = info
        .layers
        .iter()
        .find(|l| !l.head && l.name == snapshot)
        .ok_or_else(|| format!("no snapshot {snapshot:?}"))?;
    let mut chain = Vec::new();
    loop {
        if layer.incomplete {
            return Err(format!(
                "layer {:?} is incomplete (a rebuild is copying it)",
                layer.name
            ));
        }
        chain.push(layer.clone());
        if layer.parent == 0 {
            break;
        }
        layer = by_id(layer.parent).ok_or_else(|| {
            format!(
                "layer {:?} has a parent the replica does not list",
                layer.name
            )
        })?;
        if chain.len() > info.layers.len() {
            return Err("the layer chain has a cycle".into());
        }
    }
    chain.reverse();
    Ok(chain)
}

/// Stream one layer from the source into every target at once; the bytes copied.
async fn copy_layer(
    mut src: AuthClient,
    src_addr: &str,
    targets: Vec<(AuthClient, String)>,
    layer: &pb::LayerInfo,
    parent: &str,
) -> Result<u64, String> {
    let mut reader = src
        .read_layer(pb::ReadLayerRequest {
            layer: layer.name.clone(),
            extents: vec![],
        })
        .await
        .map_err(|s| {
            format!(
                "source {src_addr}: ReadLayer {}: {}",
                layer.name,
                s.message()
            )
        })?
        .into_inner();
    let first = pb::WriteLayerRequest {
        layer: layer.name.clone(),
        parent: parent.to_string(),
        user_created: layer.user_created,
        created: layer.created.clone(),
        labels: layer.labels.clone(),
        size: layer.size,
        chunk: None,
    };
    let mut senders = Vec::new();
    let mut writers = Vec::new();
    for (mut c, addr) in targets {
        let (tx, rx) = mpsc::channel::<pb::WriteLayerRequest>(4);
        tx.send(first.clone())
            .await
            .map_err(|_| format!("target {addr}: WriteLayer stream closed"))?;
        senders.push(tx);
        writers.push((
            addr,
            tokio::spawn(async move { c.write_layer(ReceiverStream::new(rx)).await }),
        ));
    }
    let mut bytes = 0u64;
    let mut source_err = None;
    loop {
        let next = match tokio::time::timeout(STALL_TIMEOUT, reader.next()).await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "no data for {} s",
                STALL_TIMEOUT.as_secs()
            ))),
        };
        match next {
            Ok(chunk) => {
                bytes += chunk.data.len() as u64;
                let msg = pb::WriteLayerRequest {
                    chunk: Some(chunk),
                    ..Default::default()
                };
                for tx in &senders {
                    // A writer that failed reports its error below.
                    let _ = tx.send(msg.clone()).await;
                }
            }
            Err(s) => {
                source_err = Some(format!(
                    "source {src_addr}: ReadLayer {}: {}",
                    layer.name,
                    s.message()
                ));
                break;
            }
        }
    }
    drop(senders);
    if let Some(e) = source_err {
        for (_, w) in &writers {
            w.abort();
        }
        return Err(e);
    }
    for (addr, w) in writers {
        w.await
            .map_err(|e| format!("target {addr}: WriteLayer task: {e}"))?
            .map_err(|s| format!("target {addr}: WriteLayer {}: {}", layer.name, s.message()))?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn population_states_read_back_as_written() {
        for p in [
            Population::Copying,
            Population::Done {
                bytes: 4096,
                millis: 12,
            },
            Population::Failed("no replica of \"a\" can provide snapshot \"s\"".into()),
        ] {
            assert_eq!(Population::parse(&p.to_string()), p);
        }
        assert_eq!(
            Population::parse("garbage"),
            Population::Failed("garbage".into())
        );
    }

    fn layer(id: u64, name: &str, parent: u64) -> pb::LayerInfo {
        pb::LayerInfo {
            id,
            name: name.into(),
            parent,
            head: name.is_empty(),
            ..Default::default()
        }
    }

    #[test]
    fn a_snapshot_chain_is_its_layer_and_ancestors_oldest_first() {
        let info = pb::InfoResponse {
            layers: vec![
                layer(1, "a", 0),
                layer(2, "b", 1),
                layer(3, "c", 2),
                layer(4, "", 3),
                layer(5, "branch", 1),
            ],
            ..Default::default()
        };
        let names = |v: Vec<pb::LayerInfo>| v.into_iter().map(|l| l.name).collect::<Vec<_>>();
        assert_eq!(names(snapshot_chain(&info, "b").expect("b")), ["a", "b"]);
        assert_eq!(
            names(snapshot_chain(&info, "branch").expect("branch")),
            ["a", "branch"]
        );
        assert!(
            snapshot_chain(&info, "").is_err(),
            "the head is no snapshot"
        );
        assert!(
            snapshot_chain(&info, "zz")
                .expect_err("missing")
                .contains("no snapshot")
        );
        let mut broken = info.clone();
        broken.layers[0].incomplete = true;
        assert!(
            snapshot_chain(&broken, "c")
                .expect_err("incomplete")
                .contains("incomplete")
        );
    }
}
