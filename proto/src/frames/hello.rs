//! The hello a client sends first, and the extension area of version 3 (module docs of
//! `frames`: "Hello extensions").

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{Decoded, FrameError, INTEGRITY_VERSION, MAGIC, u16_at, u32_at, u64_at};

/// The fixed part of every hello; version 3 adds a u32 length and the extensions.
pub const HELLO_LEN: usize = 16;
/// The largest extension area a hello (or a hello answer) may carry.
pub const MAX_HELLO_EXTENSIONS: usize = 4096;
/// Bit 15 of an extension's kind: a receiver that does not know it must refuse the hello.
pub const EXTENSION_CRITICAL: u16 = 0x8000;

/// The extension naming the client's volume (issue 18): critical, so a server that cannot
/// check the identity refuses the hello instead of serving a stranger. Its value is one flags
/// byte (bit 0: adopt, see [`VolumeClaim`]; other bits 0) followed by the uuid in ASCII.
pub const EXT_VOLUME: u16 = EXTENSION_CRITICAL | 1;
/// The longest volume uuid a hello may carry.
pub const MAX_VOLUME_UUID: usize = 64;

/// Whether `s` can be a volume uuid on the wire: 1 to [`MAX_VOLUME_UUID`] ASCII letters,
/// digits and dashes (a UUID in its usual text form is one).
pub fn valid_volume_uuid(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_VOLUME_UUID
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The volume a client says hello for: the replica refuses the hello unless it belongs to
/// that volume, or belongs to none yet and may take it (fresh, or `adopt`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeClaim {
    pub uuid: String,
    /// Set by an engine only for a replica it lists as a current member: a replica made
    /// before volume identity existed takes the uuid even though it is not fresh.
    pub adopt: bool,
}

impl VolumeClaim {
    pub fn to_extension(&self) -> Extension {
        let mut v = Vec::with_capacity(1 + self.uuid.len());
        v.push(u8::from(self.adopt));
        v.extend_from_slice(self.uuid.as_bytes());
        Extension {
            kind: EXT_VOLUME,
            value: Bytes::from(v),
        }
    }

    /// The claim among `ext`, if there is one; a malformed one is an error.
    pub fn from_extensions(ext: &Extensions) -> Result<Option<VolumeClaim>, FrameError> {
        let Some(v) = ext.get(EXT_VOLUME) else {
            return Ok(None);
        };
        let Some((&flags, uuid)) = v.split_first() else {
            return Err(FrameError::BadExtensions("an empty volume extension"));
        };
        if flags & !1 != 0 {
            return Err(FrameError::BadExtensions(
                "unknown flags in the volume extension",
            ));
        }
        let uuid = std::str::from_utf8(uuid)
            .ok()
            .filter(|u| valid_volume_uuid(u))
            .ok_or(FrameError::BadExtensions(
                "the volume extension's uuid is not 1-64 letters, digits and dashes",
            ))?;
        Ok(Some(VolumeClaim {
            uuid: uuid.to_string(),
            adopt: flags & 1 != 0,
        }))
    }
}

/// One hello extension: a kind and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extension {
    pub kind: u16,
    pub value: Bytes,
}

impl Extension {
    pub fn is_critical(&self) -> bool {
        self.kind & EXTENSION_CRITICAL != 0
    }
}

/// The extensions of a hello or of a hello answer, in the order they travel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extensions(pub Vec<Extension>);

impl Extensions {
    /// The wire form: for each, u16 kind, u16 length, the value.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        for e in &self.0 {
            b.put_u16_le(e.kind);
            // Values longer than a u16 cannot be built by `push`; cut defensively anyway.
            let v = &e.value[..e.value.len().min(usize::from(u16::MAX))];
            b.put_u16_le(v.len() as u16);
            b.extend_from_slice(v);
        }
        b
    }

    pub fn encoded_len(&self) -> usize {
        self.0
            .iter()
            .map(|e| 4 + e.value.len().min(usize::from(u16::MAX)))
            .sum()
    }

    /// Parses an extension area; every byte must belong to a whole entry.
    pub fn decode(mut b: Bytes) -> Result<Extensions, FrameError> {
        if b.len() > MAX_HELLO_EXTENSIONS {
            return Err(FrameError::TooLarge {
                what: "hello extension area",
                len: b.len() as u64,
                max: MAX_HELLO_EXTENSIONS as u64,
            });
        }
        let mut out = Vec::new();
        while !b.is_empty() {
            if b.len() < 4 {
                return Err(FrameError::BadExtensions("an entry header is cut short"));
            }
            let kind = u16_at(&b, 0);
            let len = usize::from(u16_at(&b, 2));
            if b.len() < 4 + len {
                return Err(FrameError::BadExtensions("an entry's value is cut short"));
            }
            b.advance(4);
            out.push(Extension {
                kind,
                value: b.split_to(len),
            });
        }
        Ok(Extensions(out))
    }

    pub fn get(&self, kind: u16) -> Option<&Bytes> {
        self.0.iter().find(|e| e.kind == kind).map(|e| &e.value)
    }

    /// The first critical extension whose kind is not in `known`: a reason to refuse.
    pub fn unknown_critical(&self, known: &[u16]) -> Option<u16> {
        self.0
            .iter()
            .find(|e| e.is_critical() && !known.contains(&e.kind))
            .map(|e| e.kind)
    }
}

/// The hello a client sends first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub generation: u64,
    /// Version 3 only; an older version's hello has none.
    pub extensions: Extensions,
}

impl Hello {
    /// A hello without extensions.
    pub fn new(version: u32, generation: u64) -> Hello {
        Hello {
            version,
            generation,
            extensions: Extensions::default(),
        }
    }

    /// The hello as it travels: 16 bytes, plus the extension area from version 3 on.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HELLO_LEN + 4 + self.extensions.encoded_len());
        b.extend_from_slice(&MAGIC);
        b.put_u32_le(self.version);
        b.put_u64_le(self.generation);
        if self.version >= INTEGRITY_VERSION {
            let ext = self.extensions.encode();
            b.put_u32_le(ext.len() as u32);
            b.extend_from_slice(&ext);
        }
        b
    }
}

/// Takes the hello off the front of `buf`, if it is all there. The version is not checked
/// here (the server answers a wrong one); only its magic and extension area are.
pub fn decode_hello(buf: &mut BytesMut) -> Result<Decoded<Hello>, FrameError> {
    let Some(fixed) = buf.first_chunk::<HELLO_LEN>() else {
        return Ok(Decoded::Need(HELLO_LEN));
    };
    let magic = [fixed[0], fixed[1], fixed[2], fixed[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u32_at(fixed, 4);
    let generation = u64_at(fixed, 8);
    if version < INTEGRITY_VERSION {
        buf.advance(HELLO_LEN);
        return Ok(Decoded::Frame(Hello::new(version, generation)));
    }
    if buf.len() < HELLO_LEN + 4 {
        return Ok(Decoded::Need(HELLO_LEN + 4));
    }
    let ext_len = u32_at(buf, HELLO_LEN) as usize;
    if ext_len > MAX_HELLO_EXTENSIONS {
        return Err(FrameError::TooLarge {
            what: "hello extension area",
            len: ext_len as u64,
            max: MAX_HELLO_EXTENSIONS as u64,
        });
    }
    let total = HELLO_LEN + 4 + ext_len;
    if buf.len() < total {
        return Ok(Decoded::Need(total));
    }
    buf.advance(HELLO_LEN + 4);
    let extensions = Extensions::decode(buf.split_to(ext_len).freeze())?;
    Ok(Decoded::Frame(Hello {
        version,
        generation,
        extensions,
    }))
}
