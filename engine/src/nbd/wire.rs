//! NBD wire constants and the fixed-size messages of the protocol.
//!
//! Everything on the wire is big-endian. The constants are the values fixed by the NBD
//! protocol document (`doc/proto.md` in the NetworkBlockDevice/nbd repository); only the
//! subset this server speaks is listed. Parsing never trusts a length from the peer: callers
//! check every length against a bound before allocating.

use std::fmt;

/// `"NBDMAGIC"`, first word of the newstyle greeting.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `"IHAVEOPT"`, second word of the greeting and the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple transmission reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;

// Info types for NBD_OPT_INFO / NBD_OPT_GO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Error values carried in a reply. They are the Linux errno numbers, which the protocol
/// adopted, but they are protocol constants: the server's own errno values do not leak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum NbdErrno {
    Io = 5,
    Inval = 22,
    NoSpc = 28,
    Shutdown = 108,
}

/// The fixed 28-byte header of a transmission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub magic: u32,
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    pub const LEN: usize = 28;

    pub fn parse(b: &[u8; Self::LEN]) -> RequestHeader {
        RequestHeader {
            magic: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            flags: u16::from_be_bytes([b[4], b[5]]),
            command: u16::from_be_bytes([b[6], b[7]]),
            cookie: u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
            offset: u64::from_be_bytes([b[16], b[17], b[18], b[19], b[20], b[21], b[22], b[23]]),
            length: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
        }
    }
}

/// Logs name the command instead of printing a number.
impl fmt::Display for RequestHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.command {
            CMD_READ => "READ",
            CMD_WRITE => "WRITE",
            CMD_DISC => "DISC",
            CMD_FLUSH => "FLUSH",
            CMD_TRIM => "TRIM",
            CMD_WRITE_ZEROES => "WRITE_ZEROES",
            _ => "UNKNOWN",
        };
        write!(
            f,
            "{name}({}) cookie={:#x} offset={} length={} flags={:#x}",
            self.command, self.cookie, self.offset, self.length, self.flags
        )
    }
}

/// Encodes the 16-byte simple reply header.
pub fn simple_reply(cookie: u64, error: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Encodes the 20-byte option reply header; `len` bytes of data follow it.
pub fn option_reply_header(option: u32, reply_type: u32, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..8].copy_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    b[8..12].copy_from_slice(&option.to_be_bytes());
    b[12..16].copy_from_slice(&reply_type.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_parses_big_endian_fields() {
        let mut b = [0u8; RequestHeader::LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&CMD_FLAG_FUA.to_be_bytes());
        b[6..8].copy_from_slice(&CMD_WRITE.to_be_bytes());
        b[8..16].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        b[16..24].copy_from_slice(&(1u64 << 40).to_be_bytes());
        b[24..28].copy_from_slice(&4096u32.to_be_bytes());
        let h = RequestHeader::parse(&b);
        assert_eq!(
            h,
            RequestHeader {
                magic: REQUEST_MAGIC,
                flags: CMD_FLAG_FUA,
                command: CMD_WRITE,
                cookie: 0x0102_0304_0506_0708,
                offset: 1 << 40,
                length: 4096,
            }
        );
    }

    #[test]
    fn replies_encode_magic_and_fields() {
        let r = simple_reply(7, NbdErrno::Inval as u32);
        assert_eq!(&r[0..4], &[0x67, 0x44, 0x66, 0x98]);
        assert_eq!(u32::from_be_bytes([r[4], r[5], r[6], r[7]]), 22);
        assert_eq!(r[15], 7);
        let o = option_reply_header(OPT_GO, REP_ERR_UNKNOWN, 3);
        assert_eq!(&o[0..8], &OPT_REPLY_MAGIC.to_be_bytes());
        assert_eq!(
            u32::from_be_bytes([o[12], o[13], o[14], o[15]]),
            0x8000_0006
        );
        assert_eq!(o[19], 3);
    }
}
