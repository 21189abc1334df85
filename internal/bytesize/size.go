package bytesize

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/alecthomas/kong"
)

// Size is a size in bytes that flags, environment variables and the YAML
// configuration may give in human units: "1GiB", "512MiB", "16M", "2.5GB",
// "1048576".
type Size int64

// sizeUnits maps a lowercase unit to its multiplier: IEC units (KiB, Ki, …)
// are powers of 1024, SI units (kB, MB, …) powers of 1000, and a bare letter
// (K, M, G, T) is taken as binary, the way people mean it for disks and files.
var sizeUnits = map[string]float64{
	"": 1, "b": 1,
	"k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 1e3,
	"m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20, "mb": 1e6,
	"g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 1e9,
	"t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 1e12,
}

// Parse parses a non-negative size with an optional unit.
func Parse(s string) (Size, error) {
	t := strings.TrimSpace(s)
	i := strings.IndexFunc(t, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	if i < 0 {
		i = len(t)
	}
	num, unit := t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	mult, ok := sizeUnits[unit]
	if num == "" || !ok {
		return 0, fmt.Errorf("size %q: want a number with an optional unit (B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)", s)
	}
	if !strings.Contains(num, ".") {
		n, err := strconv.ParseInt(num, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("size %q: %w", s, err)
		}
		if n > math.MaxInt64/int64(mult) {
			return 0, fmt.Errorf("size %q is too large", s)
		}
		return Size(n * int64(mult)), nil
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: %w", s, err)
	}
	v := math.Round(f * mult)
	if v >= math.MaxInt64 {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return Size(v), nil
}

// Decode implements kong.MapperValue: it accepts a string with units from a
// flag or an environment variable, and a plain number from YAML.
func (b *Size) Decode(ctx *kong.DecodeContext) error {
	tok, err := ctx.Scan.PopValue("size")
	if err != nil {
		return err
	}
	n, err := sizeOf(tok.Value)
	if err != nil {
		return err
	}
	*b = n
	return nil
}

// UnmarshalJSON accepts a string with units or a number: kong decodes the
// values of a map flag given in YAML as JSON.
func (b *Size) UnmarshalJSON(data []byte) error {
	var v any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return fmt.Errorf("size %s: %w", data, err)
	}
	if num, ok := v.(json.Number); ok {
		v = string(num)
	}
	n, err := sizeOf(v)
	if err != nil {
		return err
	}
	*b = n
	return nil
}

// sizeOf is the size a flag, environment variable or YAML value gives.
func sizeOf(value any) (Size, error) {
	switch v := value.(type) {
	case string:
		return Parse(v)
	case int:
		if v < 0 {
			return 0, fmt.Errorf("size %d is negative", v)
		}
		return Size(v), nil
	case int64:
		if v < 0 {
			return 0, fmt.Errorf("size %d is negative", v)
		}
		return Size(v), nil
	case uint64:
		if v > math.MaxInt64 {
			return 0, fmt.Errorf("size %d is too large", v)
		}
		return Size(v), nil
	case float64:
		if v < 0 || v >= math.MaxInt64 || v != math.Trunc(v) {
			return 0, fmt.Errorf("size %v is not a whole number of bytes", v)
		}
		return Size(v), nil
	}
	return 0, errors.New("size: want a number with an optional unit, such as 512MiB")
}

// String formats the size in the largest IEC unit that keeps it readable; it
// is what --help shows for defaults.
func (b Size) String() string { return IEC(int64(b)) }
