//! The newstyle fixed handshake: greeting, client flags, then option haggling until the
//! client picks the export (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`) or gives up.
//!
//! ```text
//!   S: NBDMAGIC IHAVEOPT handshake-flags      C: client-flags
//!   loop {
//!     C: IHAVEOPT option length data
//!     S: (option replies)                    LIST / INFO / unknown -> loop
//!   }                                        GO (ACK) / EXPORT_NAME -> transmission
//!                                            ABORT / EOF -> close
//! ```
//!
//! The server has exactly one export. The empty name also selects it: the protocol calls ""
//! the default export, and `nbdinfo nbd://host:port` asks for it. Every length from the
//! client is checked before anything is allocated; an option larger than
//! [`MAX_OPTION_LEN`] ends the connection because skipping an unbounded payload would let a
//! client keep us reading forever.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::NbdError;
use super::wire::*;

/// Longest option payload accepted. The largest legitimate one is `NBD_OPT_GO` with a
/// 4096-byte name (the protocol's string limit) and a handful of info requests.
pub const MAX_OPTION_LEN: u32 = 16 * 1024;

/// What the server offers: the single export.
#[derive(Debug, Clone)]
pub struct ExportInfo {
    pub name: String,
    pub size: u64,
    pub transmission_flags: u16,
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_payload: u32,
}

/// How negotiation ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The client selected the export; the transmission phase starts now.
    Transmission,
    /// The client aborted or asked for something we refuse in a way that ends the session.
    Closed,
}

/// Runs the handshake on `s`. Errors are I/O failures or protocol violations that leave no
/// way to reply; the caller just closes the connection.
pub async fn negotiate<S>(s: &mut S, export: &ExportInfo) -> Result<Outcome, NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut greeting = [0u8; 18];
    greeting[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    greeting[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    greeting[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&greeting).await?;
    s.flush().await?;

    let client_flags = s.read_u32().await?;
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        // The protocol requires closing when the client sets flags we did not offer.
        return Err(NbdError::Protocol(format!(
            "unknown client flags {client_flags:#x}"
        )));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;

    loop {
        let magic = s.read_u64().await?;
        if magic != IHAVEOPT {
            return Err(NbdError::Protocol(format!("bad option magic {magic:#x}")));
        }
        let option = s.read_u32().await?;
        let len = s.read_u32().await?;
        if len > MAX_OPTION_LEN {
            return Err(NbdError::Protocol(format!(
                "option {option} carries {len} bytes, more than {MAX_OPTION_LEN}"
            )));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).await?;
        tracing::debug!(option, len, "nbd option");

        match option {
            OPT_EXPORT_NAME => {
                if !name_matches(&data, export) {
                    // This option has no error reply: closing is the only refusal.
                    return Err(NbdError::Protocol(format!(
                        "NBD_OPT_EXPORT_NAME for unknown export {:?}",
                        String::from_utf8_lossy(&data)
                    )));
                }
                let mut b = Vec::with_capacity(10 + 124);
                b.extend_from_slice(&export.size.to_be_bytes());
                b.extend_from_slice(&export.transmission_flags.to_be_bytes());
                if !no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&b).await?;
                s.flush().await?;
                return Ok(Outcome::Transmission);
            }
            OPT_ABORT => {
                // Best effort: the client may already have gone.
                let _ = reply(s, option, REP_ACK, &[]).await;
                return Ok(Outcome::Closed);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply_err(s, option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data").await?;
                    continue;
                }
                let name = export.name.as_bytes();
                let mut d = Vec::with_capacity(4 + name.len());
                d.extend_from_slice(&(name.len() as u32).to_be_bytes());
                d.extend_from_slice(name);
                reply(s, option, REP_SERVER, &d).await?;
                reply(s, option, REP_ACK, &[]).await?;
            }
            OPT_INFO | OPT_GO => {
                let Some((name, infos)) = parse_info_request(&data) else {
                    reply_err(s, option, REP_ERR_INVALID, "malformed info request").await?;
                    continue;
                };
                if !name_matches(name, export) {
                    tracing::info!(
                        requested = %String::from_utf8_lossy(name),
                        "client asked for an unknown export"
                    );
                    reply_err(s, option, REP_ERR_UNKNOWN, "no such export").await?;
                    continue;
                }
                send_info(s, option, export, &infos).await?;
                reply(s, option, REP_ACK, &[]).await?;
                if option == OPT_GO {
                    return Ok(Outcome::Transmission);
                }
            }
            _ => {
                // STARTTLS, STRUCTURED_REPLY, meta contexts, extended headers: not offered.
                reply_err(s, option, REP_ERR_UNSUP, "option not supported").await?;
            }
        }
    }
}

fn name_matches(name: &[u8], export: &ExportInfo) -> bool {
    name.is_empty() || name == export.name.as_bytes()
}

/// Splits `NBD_OPT_INFO`/`NBD_OPT_GO` data into the export name and the requested info
/// types; `None` when the lengths inside do not add up to the option length.
fn parse_info_request(data: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let name_len = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name_end = 4usize.checked_add(name_len)?;
    let name = data.get(4..name_end)?;
    let count_bytes = data.get(name_end..name_end.checked_add(2)?)?;
    let count = usize::from(u16::from_be_bytes([count_bytes[0], count_bytes[1]]));
    let rest = &data[name_end + 2..];
    if rest.len() != count * 2 {
        return None;
    }
    let infos = rest
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Some((name, infos))
}

async fn send_info<S>(
    s: &mut S,
    option: u32,
    export: &ExportInfo,
    requested: &[u16],
) -> Result<(), NbdError>
where
    S: AsyncWrite + Unpin,
{
    let mut d = Vec::with_capacity(12);
    d.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    d.extend_from_slice(&export.size.to_be_bytes());
    d.extend_from_slice(&export.transmission_flags.to_be_bytes());
    reply(s, option, REP_INFO, &d).await?;

    // Sent even when not requested (the protocol allows it): clients that honour it split
    // their I/O at the payload limit we enforce.
    let mut d = Vec::with_capacity(14);
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    d.extend_from_slice(&export.min_block.to_be_bytes());
    d.extend_from_slice(&export.preferred_block.to_be_bytes());
    d.extend_from_slice(&export.max_payload.to_be_bytes());
    reply(s, option, REP_INFO, &d).await?;

    if requested.contains(&INFO_NAME) {
        let mut d = Vec::with_capacity(2 + export.name.len());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        d.extend_from_slice(export.name.as_bytes());
        reply(s, option, REP_INFO, &d).await?;
    }
    Ok(())
}

async fn reply<S>(s: &mut S, option: u32, reply_type: u32, data: &[u8]) -> Result<(), NbdError>
where
    S: AsyncWrite + Unpin,
{
    let len = u32::try_from(data.len())
        .map_err(|_| NbdError::Protocol("option reply too long".to_owned()))?;
    s.write_all(&option_reply_header(option, reply_type, len))
        .await?;
    s.write_all(data).await?;
    s.flush().await?;
    Ok(())
}

async fn reply_err<S>(s: &mut S, option: u32, reply_type: u32, msg: &str) -> Result<(), NbdError>
where
    S: AsyncWrite + Unpin,
{
    reply(s, option, reply_type, msg.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_request_parsing_checks_every_length() {
        let mut d = Vec::new();
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"vol");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        let (name, infos) = parse_info_request(&d).expect("well-formed");
        assert_eq!(name, b"vol");
        assert_eq!(infos, vec![INFO_NAME, INFO_BLOCK_SIZE]);

        // One info type too few, a name longer than the data, and an empty buffer.
        assert!(parse_info_request(&d[..d.len() - 2]).is_none());
        let mut long = d.clone();
        long[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_info_request(&long).is_none());
        assert!(parse_info_request(&[]).is_none());
    }
}
