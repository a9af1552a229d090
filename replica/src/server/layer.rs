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
//!
//! `WriteLayer` receives ahead of what it writes: a reader task takes messages off the
//! stream (which frees the HTTP/2 window, so the sender keeps sending) while the handler
//! writes the previous ones, in order, one at a time. A write into the page cache is a copy
//! done by the writing thread, so receiving (socket, HTTP/2, decoding) and writing overlap on
//! two threads instead of taking turns. Memory: the messages received and not yet written
//! hold at most [`READ_AHEAD_BYTES`] of data, plus the one message the reader holds while it
//! waits for room (at most `MAX_MESSAGE_BYTES`), per stream.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
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

/// Data a `WriteLayer` stream may have received and not yet written (see the module docs):
/// four of a restore's 4 MiB messages, sixteen of a rebuild's 1 MiB chunks.
pub const READ_AHEAD_BYTES: usize = 16 << 20;

/// What the reader task hands the writer: a message with the room it takes, the end of the
/// stream, or the error that broke it. The writer completes the layer only on `End`, so a
/// reader that stops any other way can never make a cut-short layer look whole.
enum Received {
    Message(Box<pb::WriteLayerRequest>, OwnedSemaphorePermit),
    End,
    Failed(Status),
}

/// Aborts the reader task when the handler returns or is dropped (the client went away).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Takes messages off `inbound` into `tx` while the writer writes earlier ones; each message
/// waits for room in `room` (its data bytes, up to the whole budget) before it is queued.
async fn read_ahead(
    mut inbound: impl Stream<Item = Result<pb::WriteLayerRequest, Status>> + Unpin,
    room: Arc<Semaphore>,
    tx: mpsc::Sender<Received>,
) {
    loop {
        let item = match inbound.next().await.transpose() {
            Ok(Some(msg)) => {
                let len = msg.chunk.as_ref().map_or(0, |c| c.data.len());
                let want = u32::try_from(len.min(READ_AHEAD_BYTES))
                    .expect("invariant: READ_AHEAD_BYTES fits in u32");
                match room.clone().acquire_many_owned(want).await {
                    Ok(permit) => Received::Message(Box::new(msg), permit),
                    Err(_) => return, // closed: the writer is gone
                }
            }
            Ok(None) => Received::End,
            Err(status) => Received::Failed(status),
        };
        let last = !matches!(item, Received::Message(..));
        if tx.send(item).await.is_err() || last {
            return;
        }
    }
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
    // The queue's length is bounded by the room (bytes); this bound only caps how many
    // messages without data may wait.
    let (tx, mut rx) = mpsc::channel(256);
    let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
    let _reader = AbortOnDrop(tokio::spawn(
        read_ahead(inbound, room.clone(), tx).in_current_span(),
    ));
    let mut bytes_written = 0u64;
    let mut next = Some(first);
    // The room of the message being written: it counts against the budget until written.
    let mut held: Option<OwnedSemaphorePermit> = None;
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
        // Given back before waiting for the next message, which may need it.
        drop(held.take());
        next = match rx.recv().await {
            Some(Received::Message(msg, room)) => {
                held = Some(room);
                Some(*msg)
            }
            Some(Received::End) => None,
            Some(Received::Failed(status)) => return Err(status),
            None => {
                return Err(Status::internal(
                    "the WriteLayer reader stopped before the stream ended",
                ));
            }
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn message(offset: u64, len: usize) -> pb::WriteLayerRequest {
        pb::WriteLayerRequest {
            chunk: Some(pb::LayerChunk {
                offset,
                data: vec![7u8; len].into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn the_reader_stops_taking_messages_when_the_unwritten_ones_fill_the_budget() {
        let piece = 4 << 20;
        let taken = Arc::new(AtomicUsize::new(0));
        let counted = taken.clone();
        let source = futures::stream::iter(0..64u64).map(move |i| {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok(message(i * piece as u64, piece))
        });
        let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
        let (tx, mut rx) = mpsc::channel(256);
        let reader = tokio::spawn(read_ahead(source, room.clone(), tx));
        // Nothing is written: the reader fills the budget, then holds one more message.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let fit = READ_AHEAD_BYTES / piece;
        assert_eq!(taken.load(Ordering::SeqCst), fit + 1);
        assert_eq!(room.available_permits(), 0);
        // Writing one (taking it and dropping its room) lets exactly one more in.
        match rx.recv().await {
            Some(Received::Message(m, permit)) => {
                assert_eq!(m.chunk.map(|c| c.offset), Some(0));
                drop(permit);
            }
            _ => panic!("the first message was not queued"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(taken.load(Ordering::SeqCst), fit + 2);
        // Draining the queue reads the rest in order, then the end.
        let mut expect = 1u64;
        loop {
            match rx.recv().await {
                Some(Received::Message(m, _)) => {
                    assert_eq!(m.chunk.map(|c| c.offset), Some(expect * piece as u64));
                    expect += 1;
                }
                Some(Received::End) => break,
                Some(Received::Failed(s)) => panic!("failed: {s}"),
                None => panic!("the reader stopped without an end"),
            }
        }
        assert_eq!(expect, 64);
        reader.await.expect("reader task");
    }

    #[tokio::test]
    async fn a_broken_stream_reaches_the_writer_as_an_error_not_an_end() {
        let source = futures::stream::iter(vec![
            Ok(message(0, 4096)),
            Err(Status::cancelled("client reset")),
            Ok(message(4096, 4096)),
        ]);
        let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
        let (tx, mut rx) = mpsc::channel(256);
        read_ahead(source, room, tx).await;
        assert!(matches!(rx.recv().await, Some(Received::Message(..))));
        assert!(
            matches!(rx.recv().await, Some(Received::Failed(s)) if s.code() == tonic::Code::Cancelled)
        );
        assert!(rx.recv().await.is_none(), "nothing after the error");
    }
}
