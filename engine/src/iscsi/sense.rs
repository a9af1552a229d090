//! SCSI status and sense data (SPC-4 §4.5).
//!
//! Commands fail with CHECK CONDITION and fixed-format sense data (response code 0x70);
//! the sense key plus additional sense code/qualifier tell the initiator why.

/// SCSI status codes.
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    /// The target cannot take this command now; the initiator retries it later.
    pub const TASK_SET_FULL: u8 = 0x28;
}

/// Sense keys.
pub mod key {
    pub const NOT_READY: u8 = 0x02;
    pub const MEDIUM_ERROR: u8 = 0x03;
    pub const ILLEGAL_REQUEST: u8 = 0x05;
    pub const DATA_PROTECT: u8 = 0x07;
    pub const ABORTED_COMMAND: u8 = 0x0b;
    pub const MISCOMPARE: u8 = 0x0e;
}

/// A CHECK CONDITION reason: sense key and additional sense code / qualifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
}

impl Sense {
    pub const INVALID_OPCODE: Sense = Sense::illegal(0x20, 0x00);
    pub const LBA_OUT_OF_RANGE: Sense = Sense::illegal(0x21, 0x00);
    pub const INVALID_FIELD_IN_CDB: Sense = Sense::illegal(0x24, 0x00);
    pub const LUN_NOT_SUPPORTED: Sense = Sense::illegal(0x25, 0x00);
    pub const INVALID_FIELD_IN_PARAM_LIST: Sense = Sense::illegal(0x26, 0x00);
    pub const PARAM_LIST_LENGTH_ERROR: Sense = Sense::illegal(0x1a, 0x00);
    pub const SAVING_PARAMS_UNSUPPORTED: Sense = Sense::illegal(0x39, 0x00);
    pub const READ_ERROR: Sense = Sense {
        key: key::MEDIUM_ERROR,
        asc: 0x11,
        ascq: 0x00,
    };
    pub const WRITE_ERROR: Sense = Sense {
        key: key::MEDIUM_ERROR,
        asc: 0x0c,
        ascq: 0x00,
    };
    pub const SPACE_ALLOCATION_FAILED: Sense = Sense {
        key: key::DATA_PROTECT,
        asc: 0x27,
        ascq: 0x07,
    };
    pub const NOT_READY_INTERVENTION: Sense = Sense {
        key: key::NOT_READY,
        asc: 0x04,
        ascq: 0x03,
    };
    pub const MISCOMPARE_DURING_VERIFY: Sense = Sense {
        key: key::MISCOMPARE,
        asc: 0x1d,
        ascq: 0x00,
    };
    /// Data-Out did not arrive as the protocol promised (iSCSI data sequence error).
    pub const DATA_PHASE_ERROR: Sense = Sense {
        key: key::ABORTED_COMMAND,
        asc: 0x4b,
        ascq: 0x00,
    };

    pub const fn illegal(asc: u8, ascq: u8) -> Sense {
        Sense {
            key: key::ILLEGAL_REQUEST,
            asc,
            ascq,
        }
    }

    /// Fixed-format sense data (18 bytes).
    pub fn fixed(&self) -> [u8; 18] {
        let mut s = [0u8; 18];
        s[0] = 0x70;
        s[2] = self.key;
        s[7] = 10;
        s[12] = self.asc;
        s[13] = self.ascq;
        s
    }

    /// Descriptor-format sense data without descriptors (8 bytes).
    pub fn descriptor(&self) -> [u8; 8] {
        [0x72, self.key, self.asc, self.ascq, 0, 0, 0, 0]
    }
}
