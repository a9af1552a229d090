//! Sync (rebuild) RPCs: list a layer's data extents, stream a layer out, write one in.
//!
//! `ReadLayer` streams only the layer's own bytes (not resolved through the chain), in
//! chunks of at most [`LAYER_CHUNK_BYTES`], from a task that takes the state's read guard
//! per chunk: a long copy never holds back `Close` or a new generation for longer than one
//! chunk. Zero chunks inside data extents are sent too, because a layer's zeros hide what
//! older layers hold.
//!
//! Checksums travel with the data (protocol version 3): every chunk carries the checksums
//! its source stores, checked there first (blocks that fail are listed, and copied as they
//! are so they stay detectably bad), and `WriteLayer` checks the data against them before
//! storing both: a copy damaged on the way is refused.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::{Instrument, info};
use zebu_proto::replica as pb;

use super::{LAYER_CHUNK_BYTES, Shared, to_status};
use crate::ReplicaError;
use crate::store::{LayerSpec, Replica};

/// `None` for the head (empty name on the wire), else the snapshot's name.
fn layer_name(name: &str) -> Option<&str> {
    (!name.is_empty()).then_some(name)
}

/// The size of a layer: the volume's for the head, the one recorded at creation else.
fn layer_size(replica: &Replica, layer: Option<&str>) -> Result<u64, Status> {
    let Some(name) = layer else {
        return Ok(replica.size());
    };
    replica
        .info()
        .layers
        .iter()
        .find(|l| !l.head && l.name == name)
        .map(|l| l.size)
        .ok_or_else(|| to_status(ReplicaError::UnknownSnapshot(name.to_string())))
}

fn range_end(offset: u64, length: u64) -> Result<u64, Status> {
    offset.checked_add(length).ok_or_else(|| {
        Status::invalid_argument(format!("range {offset}+{length} overflows 64 bits"))
    })
}

pub(super) async fn list_extents(
    shared: &Shared,
    req: pb::ListExtentsRequest,
) -> Result<pb::ListExtentsResponse, Status> {
    let cur = shared.current().await?;
    let layer = layer_name(&req.layer);
    let layer_size = layer_size(&cur.replica, layer)?;
    let end = if req.length == 0 {
        layer_size.max(req.offset)
    } else {
        range_end(req.offset, req.length)?
    };
    let extents = cur
        .replica
        .list_extents(layer, req.offset..end)
        .await
        .map_err(to_status)?;
    Ok(pb::ListExtentsResponse {
        extents: extents
            .into_iter()
            .map(|r| pb::Extent {
                offset: r.start,
                length: r.end - r.start,
            })
            .collect(),
        layer_size,
    })
}

pub(super) async fn read_layer(
    shared: Arc<Shared>,
    req: pb::ReadLayerRequest,
) -> Result<ReceiverStream<Result<pb::LayerChunk, Status>>, Status> {
    let layer = layer_name(&req.layer).map(str::to_string);
    let extents = {
        let cur = shared.current().await?;
        if req.extents.is_empty() {
            let size = layer_size(&cur.replica, layer.as_deref())?;
            cur.replica
                .list_extents(layer.as_deref(), 0..size)
                .await
                .map_err(to_status)?
        } else {
            // Checked whole before the first chunk: a range past the layer's end is an
            // error, not a stream of zeros without end.
            let size = layer_size(&cur.replica, layer.as_deref())?;
            let mut ranges = Vec::with_capacity(req.extents.len());
            for e in &req.extents {
                let end = range_end(e.offset, e.length)?;
                if end > size {
                    return Err(to_status(ReplicaError::OutOfRange {
                        offset: e.offset,
                        length: e.length,
                        size,
                    }));
                }
                ranges.push(e.offset..end);
            }
            ranges
        }
    };
    let total: u64 = extents.iter().map(|r| r.end - r.start).sum();
    info!(
        layer = layer.as_deref().unwrap_or(""),
        extents = extents.len(),
        total,
        "read layer"
    );
    let (tx, rx) = mpsc::channel(4);
    let task = async move {
        for range in extents {
            let mut offset = range.start;
            while offset < range.end {
                let len = (range.end - offset).min(LAYER_CHUNK_BYTES);
                let chunk = match shared.current().await {
                    Ok(cur) => cur
                        .replica
                        .read_layer(layer.as_deref(), offset, len)
                        .await
                        .map_err(to_status),
                    Err(status) => Err(status),
                };
                let failed = chunk.is_err();
                let item = chunk.map(|got| {
                    if !got.corrupt.is_empty() {
                        tracing::warn!(
                            layer = layer.as_deref().unwrap_or(""),
                            offset,
                            blocks = got.corrupt.len(),
                            "a layer chunk sent with blocks that fail their checksum"
                        );
                    }
                    pb::LayerChunk {
                        offset,
                        crc32c: got.sums.to_vec(),
                        corrupt: got.corrupt,
                        data: got.data,
                    }
                });
                if tx.send(item).await.is_err() || failed {
                    return;
                }
                offset += len;
            }
        }
    };
    tokio::spawn(task.in_current_span());
    Ok(ReceiverStream::new(rx))
}

pub(super) async fn write_layer(
    shared: &Shared,
    mut inbound: Streaming<pb::WriteLayerRequest>,
) -> Result<pb::WriteLayerResponse, Status> {
    let Some(first) = inbound.message().await? else {
        return Err(Status::invalid_argument(
            "WriteLayer stream carried no message",
        ));
    };
    if first.layer.is_empty() {
        return Err(Status::invalid_argument(
            "the first WriteLayer message must name the layer",
        ));
    }
    let spec = LayerSpec {
        name: first.layer.clone(),
        parent: first.parent.clone(),
        user_created: first.user_created,
        created: first.created.clone(),
        labels: first.labels.clone().into_iter().collect(),
        size: first.size,
    };
    shared
        .current()
        .await?
        .replica
        .begin_layer(&spec)
        .await
        .map_err(to_status)?;
    let name = spec.name;
    let mut bytes_written = 0u64;
    let mut next = Some(first);
    while let Some(msg) = next {
        if let Some(chunk) = msg.chunk {
            let len = chunk.data.len() as u64;
            if len > 0 {
                // An older source sends no sums: the target computes them.
                let sums = (!chunk.crc32c.is_empty())
                    .then(|| zebu_proto::sums::BlockSums::from_crcs(chunk.crc32c));
                shared
                    .current()
                    .await?
                    .replica
                    .write_layer(&name, chunk.offset, chunk.data, sums, &chunk.corrupt)
                    .await
                    .map_err(to_status)?;
                bytes_written += len;
            }
        }
        next = inbound.message().await?;
    }
    shared
        .current()
        .await?
        .replica
        .finish_layer(&name)
        .in_current_span()
        .await
        .map_err(to_status)?;
    info!(layer = %name, bytes_written, "layer written");
    Ok(pb::WriteLayerResponse { bytes_written })
}
