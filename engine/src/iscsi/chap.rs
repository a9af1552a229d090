//! CHAP authentication with MD5 (RFC 1994, as used by iSCSI in RFC 7143 §12.1.3).
//!
//! The target sends `CHAP_I` (an identifier byte) and `CHAP_C` (a random challenge); the
//! initiator answers `CHAP_N` (its user name) and `CHAP_R = MD5(I || secret || C)`. With
//! mutual CHAP the initiator also sends its own `CHAP_I`/`CHAP_C` and the target answers
//! with its user name and response over the target secret. MD5 is implemented here (it is
//! tiny) rather than pulling in a crate for one use; it is tested against RFC 1321's vectors.

/// CHAP credentials a target requires, and optionally presents for mutual CHAP.
#[derive(Clone, Debug)]
pub struct Chap {
    pub user: String,
    pub secret: String,
    /// Target-side credentials used when the initiator asks for mutual authentication.
    pub mutual: Option<(String, String)>,
}

/// MD5 digest of `parts` concatenated.
pub fn md5(parts: &[&[u8]]) -> [u8; 16] {
    const S: [u32; 64] = [
        7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 5, 9, 14, 20, 5, 9, 14, 20, 5,
        9, 14, 20, 5, 9, 14, 20, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 6, 10,
        15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21,
    ];
    // K[i] = floor(abs(sin(i + 1)) * 2^32), computed rather than tabulated; the value is
    // non-negative and below 2^32, so the cast loses neither sign nor range.
    #[allow(clippy::cast_sign_loss)]
    let k: [u32; 64] =
        std::array::from_fn(|i| ((i as f64 + 1.0).sin().abs() * 4_294_967_296.0) as u32);
    let mut msg: Vec<u8> = parts.concat();
    let bit_len = (msg.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bit_len.to_le_bytes());
    let mut st: [u32; 4] = [0x6745_2301, 0xefcd_ab89, 0x98ba_dcfe, 0x1032_5476];
    for block in msg.chunks_exact(64) {
        let m: [u32; 16] = std::array::from_fn(|i| {
            u32::from_le_bytes([
                block[4 * i],
                block[4 * i + 1],
                block[4 * i + 2],
                block[4 * i + 3],
            ])
        });
        let [mut a, mut b, mut c, mut d] = st;
        for i in 0..64 {
            let (f, g) = match i / 16 {
                0 => ((b & c) | (!b & d), i),
                1 => ((d & b) | (!d & c), (5 * i + 1) % 16),
                2 => (b ^ c ^ d, (3 * i + 5) % 16),
                _ => (c ^ (b | !d), (7 * i) % 16),
            };
            let f = f.wrapping_add(a).wrapping_add(k[i]).wrapping_add(m[g]);
            a = d;
            d = c;
            c = b;
            b = b.wrapping_add(f.rotate_left(S[i]));
        }
        st[0] = st[0].wrapping_add(a);
        st[1] = st[1].wrapping_add(b);
        st[2] = st[2].wrapping_add(c);
        st[3] = st[3].wrapping_add(d);
    }
    let mut out = [0u8; 16];
    for (i, w) in st.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// The CHAP response for identifier `id`, `secret` and `challenge`.
pub fn response(id: u8, secret: &[u8], challenge: &[u8]) -> [u8; 16] {
    md5(&[&[id], secret, challenge])
}

pub fn to_hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(2 + 2 * b.len());
    s.push_str("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// Decodes a CHAP binary value: `0x` hex or `0b` base64 (RFC 7143 §6.1).
pub fn decode_binary(v: &str) -> Option<Vec<u8>> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        if h.is_empty() {
            return None;
        }
        // Work on bytes: the value comes from the network and may hold multi-byte UTF-8
        // (or U+FFFD from lossy decoding), so slicing the str by position could panic.
        let h = h.as_bytes();
        let lead = h.len() % 2; // an odd count means an implied leading zero nibble
        let mut out = Vec::with_capacity(h.len() / 2 + 1);
        if lead == 1 {
            out.push(hex_nibble(h[0])?);
        }
        for pair in h[lead..].chunks_exact(2) {
            out.push((hex_nibble(pair[0])? << 4) | hex_nibble(pair[1])?);
        }
        return Some(out);
    }
    if let Some(b) = v.strip_prefix("0b").or_else(|| v.strip_prefix("0B")) {
        return decode_base64(b);
    }
    None
}

fn hex_nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// Constant-time comparison so a wrong response leaks nothing through timing.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        to_hex(b)[2..].to_string()
    }

    #[test]
    fn md5_matches_rfc1321_vectors() {
        assert_eq!(hex(&md5(&[b""])), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hex(&md5(&[b"abc"])), "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(
            hex(&md5(&[
                b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"
            ])),
            "57edf4a22be3c955ac49da2e2107b67a"
        );
        assert_eq!(
            hex(&md5(&[b"message ", b"digest"])),
            "f96b697d7cb7938d525a2f31aaf161d0"
        );
    }

    #[test]
    fn binary_values_decode() {
        assert_eq!(decode_binary("0x0aff"), Some(vec![0x0a, 0xff]));
        assert_eq!(decode_binary("0xaff"), Some(vec![0x0a, 0xff]));
        assert_eq!(decode_binary("0bAQID"), Some(vec![1, 2, 3]));
        assert_eq!(decode_binary("zz"), None);
        assert_eq!(decode_binary("0xzz"), None);
    }

    #[test]
    fn hex_value_with_multibyte_utf8_is_rejected_not_a_panic() {
        // Found by the iscsi_login fuzz target: "0x" followed by U+FFFD used to slice the
        // str inside a character.
        assert_eq!(decode_binary("0xa\u{fffd}b"), None);
        assert_eq!(decode_binary("0x\u{e9}"), None);
        // from_str_radix accepted a sign; a nibble parser must not.
        assert_eq!(decode_binary("0x+f"), None);
        assert_eq!(decode_binary("0xabc"), Some(vec![0x0a, 0xbc]));
        assert_eq!(decode_binary("0XFF00"), Some(vec![0xff, 0x00]));
    }
}
