//! Byte sizes as people type them: `10G`, `1Ti`, `512M`, `4096`.
//!
//! Both decimal-looking suffixes (`K`, `M`, `G`, `T`, `P`) and binary ones
//! (`Ki`, `Mi`, `Gi`, `Ti`, `Pi`) mean powers of 1024: this is block storage,
//! where "a 10G volume" always means 10 GiB, and Kubernetes quantities written
//! as `10Gi` must give the same number. A trailing `B` (`10GB`, `10GiB`) is
//! accepted and ignored. Parsing is strict: no fractions, no signs, no
//! whitespace inside, and overflow is an error rather than a wrap.
//!
//! [`ByteSize`] is the one type every resource uses for a size; it serialises
//! as a plain integer of bytes so the stored JSON and the CRD schema are exact.
//!
//! The parsing itself is `zebu-size`'s, the one size parser of every Zebu program (the
//! replica and engine command lines and the benchmarks use it too).

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A number of bytes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

impl JsonSchema for ByteSize {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ByteSize".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "integer", "format": "uint64", "minimum": 0 })
    }
}

pub use zebu_size::SizeError;

impl FromStr for ByteSize {
    type Err = SizeError;

    fn from_str(input: &str) -> Result<Self, SizeError> {
        zebu_size::parse(input).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the size exactly (`10 GiB`,
    /// `1536 MiB`), so printing never rounds a size someone has to trust.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 == 0 {
            return write!(f, "0 B");
        }
        let mut power = 0;
        let mut value = self.0;
        while power < 5 && value.is_multiple_of(1024) {
            value /= 1024;
            power += 1;
        }
        write!(f, "{value} {}", NAMES[power])
    }
}

impl ByteSize {
    pub const KIB: u64 = 1024;
    pub const MIB: u64 = 1024 * 1024;
    pub const GIB: u64 = 1024 * 1024 * 1024;

    pub fn bytes(self) -> u64 {
        self.0
    }

    /// A rounded, human form for capacities that are not exact (`14.9 GiB`).
    pub fn approx(self) -> String {
        const NAMES: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut value = self.0 as f64;
        let mut power = 0;
        while power < 5 && value >= 1024.0 {
            value /= 1024.0;
            power += 1;
        }
        if power == 0 || value.fract() == 0.0 {
            format!("{value:.0} {}", NAMES[power])
        } else {
            format!("{value:.1} {}", NAMES[power])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<u64, SizeError> {
        s.parse::<ByteSize>().map(|b| b.0)
    }

    // The grammar itself is zebu-size's and tested there; here only that ByteSize takes it
    // whole, errors included.
    #[test]
    fn parsing_is_zebu_sizes() {
        for input in [
            "4096", "512Mi", "10G", "2gib", "16383P", "", "1.5G", "10X", "16384P",
        ] {
            assert_eq!(parse(input), zebu_size::parse(input), "{input:?}");
        }
    }

    #[test]
    fn display_is_exact() {
        assert_eq!(ByteSize(10 << 30).to_string(), "10 GiB");
        assert_eq!(ByteSize(1536 << 20).to_string(), "1536 MiB");
        assert_eq!(ByteSize(4097).to_string(), "4097 B");
        assert_eq!(
            ByteSize(15 * ByteSize::GIB + ByteSize::GIB / 2).approx(),
            "15.5 GiB"
        );
    }
}
