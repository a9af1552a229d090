//! Login phase (RFC 7143 §6, §11.12-11.13): security negotiation (None or CHAP), operational
//! parameter negotiation, and the move to the full feature phase.
//!
//! ```text
//!   SecurityNegotiation(0) --T--> LoginOperationalNegotiation(1) --T--> FullFeature(3)
//!            \_________________________T (NSG=3)________________________/
//! ```
//! The initiator proposes, the target answers every negotiable key with the result of the
//! key's result function (min, max, OR, AND, or the first of a list we support). Any
//! failure ends in a Login Response with a non-zero status and the connection is closed.
//!
//! A response longer than the initiator accepts in one PDU (8,192 bytes during login, or
//! less if it declared a smaller MaxRecvDataSegmentLength) goes out in pieces with the C bit
//! set, each asked for by an empty Login Request; the stage transition (T) and the TSIH come
//! with the last piece (see [`super::text`]).

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};

use super::chap::{self, Chap};
use super::pdu::{Bhs, PduReader, ReadOutcome, op, write_pdu};
use super::text::{LOGIN_SEGMENT, next_piece};

/// Our MaxRecvDataSegmentLength: the largest data segment we accept.
pub const TARGET_MRDSL: u32 = 262_144;
/// Commands the target lets each session have in flight (CmdSN window).
pub const QUEUE_DEPTH: u32 = 128;
/// Most login text (across Continue PDUs) one login request may carry. Real initiators send
/// well under 4 KiB; without a bound a peer could grow it without limit until the login
/// timeout.
pub const MAX_LOGIN_TEXT: usize = super::text::MAX_TEXT;

/// Negotiated connection and session parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    pub header_digest: bool,
    pub data_digest: bool,
    /// The initiator's MaxRecvDataSegmentLength: the largest Data-In segment we may send.
    pub initiator_mrdsl: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_outstanding_r2t: u32,
}

impl Default for Params {
    /// The RFC 7143 defaults, in force for every key the initiator does not negotiate.
    fn default() -> Params {
        Params {
            header_digest: false,
            data_digest: false,
            initiator_mrdsl: 8192,
            max_burst: 262_144,
            first_burst: 65_536,
            initial_r2t: true,
            immediate_data: true,
            max_outstanding_r2t: 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionKind {
    Normal,
    Discovery,
}

/// What a successful login produced.
#[derive(Debug)]
pub struct Login {
    pub kind: SessionKind,
    pub params: Params,
    pub initiator: String,
    pub isid: [u8; 6],
    pub tsih: u16,
    /// CmdSN the first full-feature command will carry.
    pub exp_cmd_sn: u32,
    /// StatSN of the first full-feature response.
    pub stat_sn: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("reading login PDU: {0}")]
    Pdu(#[from] super::pdu::PduError),
    #[error("writing login response: {0}")]
    Io(#[from] std::io::Error),
    #[error("connection closed during login")]
    Closed,
    #[error("login failed with status {status:#06x} for initiator {initiator:?}: {why}")]
    Rejected {
        status: u16,
        initiator: String,
        why: String,
    },
    #[error("unexpected opcode {0:#04x} during login")]
    UnexpectedOpcode(u8),
}

pub mod status {
    pub const AUTH_FAILED: u16 = 0x0201;
    pub const NOT_FOUND: u16 = 0x0203;
    pub const UNSUPPORTED_VERSION: u16 = 0x0205;
    pub const MISSING_PARAMETER: u16 = 0x0207;
    pub const SESSION_DOES_NOT_EXIST: u16 = 0x020a;
    pub const INITIATOR_ERROR: u16 = 0x0200;
}

/// Splits a text data segment into `key=value` pairs.
pub fn parse_keys(data: &[u8]) -> Vec<(String, String)> {
    data.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let s = String::from_utf8_lossy(s);
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

pub fn push_key(out: &mut Vec<u8>, k: &str, v: &str) {
    out.extend_from_slice(k.as_bytes());
    out.push(b'=');
    out.extend_from_slice(v.as_bytes());
    out.push(0);
}

fn yes_no(b: bool) -> &'static str {
    if b { "Yes" } else { "No" }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn num(v: &str, lo: u32, hi: u32) -> Option<u32> {
    v.parse::<u32>().ok().filter(|n| (lo..=hi).contains(n))
}

/// Answers one operational key, updating `p`. Returns the reply value, or None when the key
/// is declarative and needs no answer.
pub fn negotiate(p: &mut Params, key: &str, v: &str) -> Option<String> {
    let reject = || Some("Reject".to_string());
    match key {
        "HeaderDigest" | "DataDigest" => {
            let pick = v.split(',').find(|x| *x == "CRC32C" || *x == "None");
            let Some(pick) = pick else { return reject() };
            if key == "HeaderDigest" {
                p.header_digest = pick == "CRC32C";
            } else {
                p.data_digest = pick == "CRC32C";
            }
            Some(pick.to_string())
        }
        "MaxRecvDataSegmentLength" => {
            let Some(n) = num(v, 512, 16_777_215) else {
                return reject();
            };
            p.initiator_mrdsl = n;
            None
        }
        "MaxBurstLength" | "FirstBurstLength" => {
            let Some(n) = num(v, 512, 16_777_215) else {
                return reject();
            };
            if key == "MaxBurstLength" {
                p.max_burst = n;
            } else {
                p.first_burst = n;
            }
            Some(n.to_string())
        }
        "InitialR2T" => {
            let Some(b) = parse_bool(v) else {
                return reject();
            };
            // Result function OR: we are happy without an initial R2T.
            p.initial_r2t = b;
            Some(yes_no(b).to_string())
        }
        "ImmediateData" => {
            let Some(b) = parse_bool(v) else {
                return reject();
            };
            p.immediate_data = b;
            Some(yes_no(b).to_string())
        }
        "MaxOutstandingR2T" => {
            let Some(n) = num(v, 1, 65535) else {
                return reject();
            };
            p.max_outstanding_r2t = n.min(16);
            Some(p.max_outstanding_r2t.to_string())
        }
        "MaxConnections" => num(v, 1, 65535).map(|_| "1".to_string()).or_else(reject),
        "ErrorRecoveryLevel" => num(v, 0, 2).map(|_| "0".to_string()).or_else(reject),
        "DefaultTime2Wait" => num(v, 0, 3600)
            .map(|n| n.max(2).to_string())
            .or_else(reject),
        "DefaultTime2Retain" => num(v, 0, 3600)
            .map(|n| n.min(20).to_string())
            .or_else(reject),
        // We deliver data in order only; OR with our Yes gives Yes.
        "DataPDUInOrder" | "DataSequenceInOrder" => Some("Yes".to_string()),
        "IFMarker" | "OFMarker" => Some("No".to_string()),
        "OFMarkInt" | "IFMarkInt" => Some("Irrelevant".to_string()),
        "InitiatorName" | "InitiatorAlias" | "TargetName" | "SessionType" | "AuthMethod"
        | "TargetAlias" => None,
        _ => Some("NotUnderstood".to_string()),
    }
}

/// Enforces the rules that tie keys together once negotiation is over: RFC 7143 §13.14
/// requires FirstBurstLength <= MaxBurstLength, and the session code relies on it when it
/// sizes unsolicited bursts.
pub fn finish_params(p: &mut Params) {
    p.first_burst = p.first_burst.min(p.max_burst);
}

#[derive(Debug, PartialEq, Eq)]
enum Auth {
    /// Nothing agreed yet.
    Start,
    /// AuthMethod=CHAP agreed; waiting for CHAP_A.
    WaitAlgorithm,
    /// Challenge sent; waiting for CHAP_N/CHAP_R.
    WaitResponse {
        id: u8,
        challenge: [u8; 16],
    },
    Done,
}

/// Static configuration the login needs.
pub struct LoginConfig<'a> {
    pub target_iqn: &'a str,
    pub chap: Option<&'a Chap>,
    pub next_tsih: &'a (dyn Fn() -> u16 + Sync),
}

fn fail(status: u16, initiator: &str, why: impl Into<String>) -> LoginError {
    LoginError::Rejected {
        status,
        initiator: initiator.to_string(),
        why: why.into(),
    }
}

/// Runs the login phase on a fresh connection.
pub async fn login<R, W>(
    reader: &mut PduReader<R>,
    w: &mut W,
    cfg: &LoginConfig<'_>,
) -> Result<Login, LoginError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut params = Params::default();
    let mut auth = Auth::Start;
    let mut kind = None;
    let mut initiator = String::new();
    let mut target_name = None;
    let mut stage = None::<u8>;
    let mut stat_sn = 0u32;
    let mut first = true;
    let mut pending = Vec::new();
    let mut declared_mrdsl = false;
    let mut sent_tpgt = false;
    let mut tsih = 0u16;
    let mut isid = [0u8; 6];
    // The rest of a response sent in pieces: (text, whether it transits, its NSG).
    let mut unsent: Option<(Bytes, bool, u8)> = None;
    loop {
        let pdu = match reader.read().await? {
            ReadOutcome::Pdu(p) => p,
            ReadOutcome::Eof => return Err(LoginError::Closed),
            ReadOutcome::DataDigestError(_) => {
                return Err(fail(
                    status::INITIATOR_ERROR,
                    &initiator,
                    "digest error in login",
                ));
            }
        };
        let b = &pdu.bhs;
        if b.opcode() != op::LOGIN_REQ {
            return Err(LoginError::UnexpectedOpcode(b.opcode()));
        }
        let flags = b.flags();
        let transit = flags & 0x80 != 0;
        let cont = flags & 0x40 != 0;
        let csg = (flags >> 2) & 3;
        let nsg = flags & 3;
        let cmd_sn = b.cmd_sn();
        if first {
            stat_sn = b.u32_at(28);
            isid.copy_from_slice(&b.0[8..14]);
            tsih = u16::from_be_bytes([b.0[14], b.0[15]]);
            first = false;
        }
        let mut resp = Bhs::new(op::LOGIN_RESP);
        resp.0[1] = (csg << 2) | nsg;
        resp.0[8..14].copy_from_slice(&isid);
        resp.set_itt(b.itt());
        resp.set_u32(24, stat_sn);
        stat_sn = stat_sn.wrapping_add(1);
        resp.set_u32(28, cmd_sn);
        resp.set_u32(32, cmd_sn.wrapping_add(QUEUE_DEPTH - 1));

        let result = async {
            if b.0[3] > 0 {
                return Err(fail(status::UNSUPPORTED_VERSION, &initiator, "version"));
            }
            if tsih != 0 {
                // Adding connections to an existing session is not supported (MaxConnections=1).
                return Err(fail(
                    status::SESSION_DOES_NOT_EXIST,
                    &initiator,
                    "TSIH given",
                ));
            }
            if let Some((rest, go, answer_nsg)) = unsent.take() {
                // The initiator asks for the next piece with an empty request in the same
                // stage (RFC 7143 §6.2, text mode negotiation).
                if !pdu.data.is_empty() || cont || stage.is_some_and(|s| s != csg) {
                    return Err(fail(
                        status::INITIATOR_ERROR,
                        &initiator,
                        "expected an empty request for the rest of a login response",
                    ));
                }
                return Ok((rest, go, answer_nsg));
            }
            if pending.len() + pdu.data.len() > MAX_LOGIN_TEXT {
                return Err(fail(
                    status::INITIATOR_ERROR,
                    &initiator,
                    "login text too long",
                ));
            }
            pending.extend_from_slice(&pdu.data);
            if cont {
                return Ok((Bytes::new(), false, nsg));
            }
            let keys = parse_keys(&std::mem::take(&mut pending));
            if csg == 2 || csg == 3 || stage.is_some_and(|s| s != csg) {
                return Err(fail(status::INITIATOR_ERROR, &initiator, "bad stage"));
            }
            let mut out = Vec::new();
            for (k, v) in &keys {
                match k.as_str() {
                    "InitiatorName" => initiator = v.clone(),
                    "TargetName" => target_name = Some(v.clone()),
                    "SessionType" => {
                        kind = Some(match v.as_str() {
                            "Discovery" => SessionKind::Discovery,
                            "Normal" => SessionKind::Normal,
                            _ => return Err(fail(0x0209, &initiator, "session type")),
                        })
                    }
                    _ => {}
                }
            }
            if stage.is_none() {
                if initiator.is_empty() {
                    return Err(fail(
                        status::MISSING_PARAMETER,
                        &initiator,
                        "no InitiatorName",
                    ));
                }
                let k = *kind.get_or_insert(SessionKind::Normal);
                if k == SessionKind::Normal {
                    match &target_name {
                        None => {
                            return Err(fail(
                                status::MISSING_PARAMETER,
                                &initiator,
                                "no TargetName",
                            ));
                        }
                        Some(t) if t != cfg.target_iqn => {
                            return Err(fail(status::NOT_FOUND, &initiator, format!("target {t}")));
                        }
                        _ => {}
                    }
                }
            }
            stage = Some(csg);
            let need_chap = cfg.chap.is_some() && kind == Some(SessionKind::Normal);
            if csg == 0 {
                security(
                    &keys,
                    cfg.chap.filter(|_| need_chap),
                    &mut auth,
                    &initiator,
                    &mut out,
                )?;
            } else if need_chap && auth != Auth::Done {
                return Err(fail(
                    status::AUTH_FAILED,
                    &initiator,
                    "skipped authentication",
                ));
            }
            for (k, v) in &keys {
                if k.starts_with("CHAP_") || k == "AuthMethod" {
                    continue;
                }
                if let Some(reply) = negotiate(&mut params, k, v) {
                    push_key(&mut out, k, &reply);
                }
            }
            if kind == Some(SessionKind::Normal) && !sent_tpgt {
                push_key(&mut out, "TargetPortalGroupTag", "1");
                sent_tpgt = true;
            }
            let can_transit = csg != 0 || auth == Auth::Done || (!need_chap && auth == Auth::Start);
            let go = transit && can_transit;
            if (csg == 1 || (go && nsg == 3)) && !declared_mrdsl {
                push_key(
                    &mut out,
                    "MaxRecvDataSegmentLength",
                    &TARGET_MRDSL.to_string(),
                );
                declared_mrdsl = true;
            }
            Ok((Bytes::from(out), go, nsg))
        }
        .await;

        match result {
            Ok((mut text, go, nsg)) => {
                let seg = LOGIN_SEGMENT.min(params.initiator_mrdsl as usize);
                let out = next_piece(&mut text, seg);
                if !text.is_empty() {
                    // C set, T clear (RFC 7143 §11.13, Login Response); NSG is reserved without T.
                    resp.0[1] = (csg << 2) | 0x40;
                    resp.set_data_len(out.len());
                    write_pdu(w, &resp, &out, false, false).await?;
                    unsent = Some((text, go, nsg));
                    continue;
                }
                resp.0[1] = (csg << 2) | nsg;
                if go {
                    resp.0[1] |= 0x80;
                    stage = Some(nsg);
                } else {
                    resp.0[1] &= !0x03;
                }
                let full = go && nsg == 3;
                if full {
                    tsih = (cfg.next_tsih)();
                    resp.0[14..16].copy_from_slice(&tsih.to_be_bytes());
                }
                resp.set_data_len(out.len());
                write_pdu(w, &resp, &out, false, false).await?;
                if full {
                    finish_params(&mut params);
                    return Ok(Login {
                        kind: kind.unwrap_or(SessionKind::Normal),
                        params,
                        initiator,
                        isid,
                        tsih,
                        exp_cmd_sn: cmd_sn,
                        stat_sn,
                    });
                }
            }
            Err(e) => {
                if let LoginError::Rejected { status, .. } = &e {
                    resp.0[1] = 0;
                    resp.0[36..38].copy_from_slice(&status.to_be_bytes());
                    write_pdu(w, &resp, &Bytes::new(), false, false).await?;
                }
                return Err(e);
            }
        }
    }
}

/// Handles the security-stage keys: AuthMethod and the CHAP exchange.
fn security(
    keys: &[(String, String)],
    chap_cfg: Option<&Chap>,
    auth: &mut Auth,
    initiator: &str,
    out: &mut Vec<u8>,
) -> Result<(), LoginError> {
    let get = |k: &str| keys.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str());
    if let Some(methods) = get("AuthMethod") {
        let offered: Vec<&str> = methods.split(',').collect();
        match chap_cfg {
            Some(_) if offered.contains(&"CHAP") => {
                push_key(out, "AuthMethod", "CHAP");
                *auth = Auth::WaitAlgorithm;
            }
            Some(_) => return Err(fail(status::AUTH_FAILED, initiator, "CHAP required")),
            None if offered.contains(&"None") => {
                push_key(out, "AuthMethod", "None");
                *auth = Auth::Done;
            }
            None => return Err(fail(status::AUTH_FAILED, initiator, "no common AuthMethod")),
        }
    }
    let Some(cfg) = chap_cfg else {
        return Ok(());
    };
    if let Some(alg) = get("CHAP_A") {
        if *auth != Auth::WaitAlgorithm || !alg.split(',').any(|a| a == "5") {
            return Err(fail(status::AUTH_FAILED, initiator, "CHAP_A"));
        }
        let id: u8 = rand::random();
        let challenge: [u8; 16] = rand::random();
        push_key(out, "CHAP_A", "5");
        push_key(out, "CHAP_I", &id.to_string());
        push_key(out, "CHAP_C", &chap::to_hex(&challenge));
        *auth = Auth::WaitResponse { id, challenge };
        return Ok(());
    }
    if let Auth::WaitResponse { id, challenge } = *auth {
        let (Some(name), Some(resp)) = (get("CHAP_N"), get("CHAP_R")) else {
            return Err(fail(
                status::AUTH_FAILED,
                initiator,
                "missing CHAP_N/CHAP_R",
            ));
        };
        let expected = chap::response(id, cfg.secret.as_bytes(), &challenge);
        let got = chap::decode_binary(resp).unwrap_or_default();
        if name != cfg.user || !chap::ct_eq(&got, &expected) {
            return Err(fail(
                status::AUTH_FAILED,
                initiator,
                "CHAP response mismatch",
            ));
        }
        if let (Some(ii), Some(ic)) = (get("CHAP_I"), get("CHAP_C")) {
            // Mutual CHAP: the initiator authenticates us.
            let Some((tuser, tsecret)) = &cfg.mutual else {
                return Err(fail(
                    status::AUTH_FAILED,
                    initiator,
                    "mutual CHAP not configured",
                ));
            };
            let iid = ii.parse::<u8>().ok();
            let ichal = chap::decode_binary(ic).filter(|c| !c.is_empty());
            let (Some(iid), Some(ichal)) = (iid, ichal) else {
                return Err(fail(status::AUTH_FAILED, initiator, "bad mutual challenge"));
            };
            if ichal[..] == challenge[..] {
                // A reflected challenge would make us compute the initiator's answer for it.
                return Err(fail(status::AUTH_FAILED, initiator, "reflected challenge"));
            }
            push_key(out, "CHAP_N", tuser);
            let r = chap::response(iid, tsecret.as_bytes(), &ichal);
            push_key(out, "CHAP_R", &chap::to_hex(&r));
        }
        *auth = Auth::Done;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::pdu::BHS_LEN;
    use super::*;

    #[test]
    fn keys_parse_and_negotiate() {
        let keys = parse_keys(b"HeaderDigest=CRC32C,None\0MaxBurstLength=1024\0X-foo=1\0\0");
        assert_eq!(keys.len(), 3);
        let mut p = Params::default();
        assert_eq!(
            negotiate(&mut p, "HeaderDigest", "CRC32C,None").as_deref(),
            Some("CRC32C")
        );
        assert!(p.header_digest);
        assert_eq!(
            negotiate(&mut p, "MaxBurstLength", "1024").as_deref(),
            Some("1024")
        );
        assert_eq!(p.max_burst, 1024);
        assert_eq!(
            negotiate(&mut p, "X-foo", "1").as_deref(),
            Some("NotUnderstood")
        );
        assert_eq!(
            negotiate(&mut p, "MaxBurstLength", "12").as_deref(),
            Some("Reject")
        );
        assert_eq!(negotiate(&mut p, "MaxRecvDataSegmentLength", "4096"), None);
        assert_eq!(p.initiator_mrdsl, 4096);
    }

    #[test]
    fn first_burst_never_exceeds_max_burst() {
        let mut p = Params::default();
        for (k, v) in parse_keys(b"FirstBurstLength=262144\0MaxBurstLength=16384\0") {
            negotiate(&mut p, &k, &v);
        }
        finish_params(&mut p);
        assert_eq!(p.max_burst, 16384);
        assert_eq!(p.first_burst, 16384);
    }

    #[test]
    fn login_text_across_continue_pdus_is_bounded() {
        // Continue PDUs of 60 KiB each: the second pushes the text over the bound.
        let chunk = vec![b'a'; 60 * 1024];
        let mut wire = Vec::new();
        for _ in 0..3 {
            let mut b = Bhs::new(op::LOGIN_REQ | 0x40);
            b.0[1] = 0x40 | 0x01;
            b.set_data_len(chunk.len());
            let mut scratch = bytes::BytesMut::new();
            let mut out = Vec::new();
            super::super::pdu::encode(
                &b,
                &Bytes::from(chunk.clone()),
                false,
                false,
                &mut scratch,
                &mut out,
            );
            wire.extend(out.iter().flat_map(|x| x.iter().copied()));
        }
        let mut r = PduReader::new(&wire[..], TARGET_MRDSL as usize);
        let mut resp = Vec::new();
        let tsih = || 1u16;
        let cfg = LoginConfig {
            target_iqn: "iqn.x:y",
            chap: None,
            next_tsih: &tsih,
        };
        let err =
            futures::executor::block_on(login(&mut r, &mut resp, &cfg)).expect_err("must fail");
        assert!(
            matches!(
                err,
                LoginError::Rejected {
                    status: status::INITIATOR_ERROR,
                    ..
                }
            ),
            "{err}"
        );
        // An empty answer to the first Continue PDU, then the failure for the second.
        assert_eq!(resp.len(), 2 * BHS_LEN);
        assert_eq!(
            &resp[BHS_LEN + 36..BHS_LEN + 38],
            &status::INITIATOR_ERROR.to_be_bytes()
        );
    }
}
