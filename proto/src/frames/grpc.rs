//! The gRPC `Data` stream's messages as the frames types: a replica decodes both transports
//! into one [`Request`] and answers both with one [`Response`], and an engine speaks both
//! from the same types.

use super::{Request, RequestOp, Response};
use crate::ids::RequestId;
use crate::replica as pb;
use crate::replica::data_request::Op;
use crate::sums::{BlockSums, SUM_BLOCK};

/// A gRPC data message that is not a request the stream can run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrpcRequestError {
    #[error("request has no operation")]
    NoOp,
    #[error("hello is only valid as the first message of a stream")]
    Hello,
    #[error("the write carries {sums} block checksums for {len} bytes of data")]
    SumsMismatch { sums: usize, len: usize },
}

impl TryFrom<pb::DataRequest> for Request {
    type Error = GrpcRequestError;

    fn try_from(r: pb::DataRequest) -> Result<Request, GrpcRequestError> {
        let op = match r.op.ok_or(GrpcRequestError::NoOp)? {
            Op::Hello(_) => return Err(GrpcRequestError::Hello),
            Op::Read(o) => RequestOp::Read {
                offset: o.offset,
                length: o.length,
            },
            Op::Write(w) => {
                let sums = if w.crc32c.is_empty() {
                    None
                } else if w.data.len().is_multiple_of(SUM_BLOCK)
                    && w.crc32c.len() == w.data.len() / SUM_BLOCK
                {
                    Some(BlockSums::from_crcs(w.crc32c))
                } else {
                    return Err(GrpcRequestError::SumsMismatch {
                        sums: w.crc32c.len(),
                        len: w.data.len(),
                    });
                };
                RequestOp::Write {
                    offset: w.offset,
                    data: w.data,
                    sums,
                    flush: w.flush_number,
                }
            }
            Op::Unmap(u) => RequestOp::Unmap {
                offset: u.offset,
                length: u.length,
                zero_fill: u.zero_fill,
            },
            Op::Flush(f) => RequestOp::Flush {
                flush_number: f.flush_number,
            },
            Op::Ping(_) => RequestOp::Ping,
        };
        Ok(Request {
            id: RequestId(r.id),
            op,
        })
    }
}

impl From<Request> for pb::DataRequest {
    fn from(r: Request) -> pb::DataRequest {
        let op = match r.op {
            RequestOp::Read { offset, length } => Op::Read(pb::ReadOp { offset, length }),
            RequestOp::Write {
                offset,
                data,
                sums,
                flush,
            } => Op::Write(pb::WriteOp {
                offset,
                crc32c: sums.map(|s| s.to_vec()).unwrap_or_default(),
                data,
                flush_number: flush,
            }),
            RequestOp::Unmap {
                offset,
                length,
                zero_fill,
            } => Op::Unmap(pb::UnmapOp {
                offset,
                length,
                zero_fill,
            }),
            RequestOp::Flush { flush_number } => Op::Flush(pb::FlushOp { flush_number }),
            RequestOp::Ping => Op::Ping(pb::PingOp {}),
        };
        pb::DataRequest {
            id: r.id.0,
            op: Some(op),
        }
    }
}

impl From<Response> for pb::DataResponse {
    fn from(r: Response) -> pb::DataResponse {
        pb::DataResponse {
            id: r.id.0,
            status: r.status as i32,
            message: r.message,
            data: r.data,
            flush_number: r.flush_number,
            corrupt_blocks: r.corrupt,
        }
    }
}

impl From<pb::DataResponse> for Response {
    /// A status this build does not know is an I/O error: the request did not succeed.
    fn from(r: pb::DataResponse) -> Response {
        Response {
            id: RequestId(r.id),
            status: pb::Status::try_from(r.status).unwrap_or(pb::Status::IoError),
            end: false,
            message: r.message,
            flush_number: r.flush_number,
            data: r.data,
            corrupt: r.corrupt_blocks,
        }
    }
}
