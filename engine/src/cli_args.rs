//! Parsing of the sizes and durations people type on command lines.

pub use zebu_size::SizeError;

/// Parses a size like [`parse_bytes`] and refuses zero.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    zebu_size::parse_nonzero(s)
}

/// Parses `0`, `4096`, `512M`, `10G`, `1T`, `2GiB` (binary units, any case): `zebu-size`, the
/// one size parser of every Zebu program.
pub fn parse_bytes(s: &str) -> Result<u64, SizeError> {
    zebu_size::parse(s)
}

/// A duration on a command line that [`parse_duration`] refuses; the text names the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("invalid duration '{input}': expected a number like 5s or 500ms")]
    NotANumber { input: String },
    #[error("invalid duration '{input}': unknown unit '{unit}' (use ms, s, m or h)")]
    UnknownUnit { input: String, unit: String },
    #[error("invalid duration '{input}': must be positive")]
    OutOfRange { input: String },
}

/// Parses `5s`, `500ms`, `2m`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, DurationError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| DurationError::NotANumber {
        input: s.to_string(),
    })?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        other => {
            return Err(DurationError::UnknownUnit {
                input: s.to_string(),
                unit: other.to_string(),
            });
        }
    };
    if !(secs > 0.0 && secs < 86_400.0 * 365.0) {
        return Err(DurationError::OutOfRange {
            input: s.to_string(),
        });
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1t"), Ok(1 << 40));
        assert!(
            parse_size("10Q")
                .unwrap_err()
                .to_string()
                .contains("unknown unit \"Q\"")
        );
        assert!(parse_size("G").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(parse_bytes("0"), Ok(0));
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s"), Ok(std::time::Duration::from_secs(5)));
        assert_eq!(
            parse_duration("500ms"),
            Ok(std::time::Duration::from_millis(500))
        );
        assert!(parse_duration("-1s").is_err());
        assert_eq!(
            parse_duration("2h"),
            Ok(std::time::Duration::from_secs(7200))
        );
        assert_eq!(
            parse_duration("5d").unwrap_err().to_string(),
            "invalid duration '5d': unknown unit 'd' (use ms, s, m or h)"
        );
    }
}
