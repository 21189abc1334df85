package csi

import (
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// AnyNamespace as an allowlist key applies to every namespace.
const AnyNamespace = "*"

// ErrNotAllowed is returned by Allowlist.Check for a reference the pod's
// namespace may not mount.
var ErrNotAllowed = errors.New("reference not allowed for this namespace")

// Allowlist says which reference prefixes each namespace may mount. A nil
// Allowlist allows everything: what a namespace can then fetch is still bound
// by whose credentials the fetch may use (--agent-credentials).
type Allowlist map[string][]string

// ParseAllowlist parses "NS=PREFIX[;PREFIX…],…"; NS may be "*" for every
// namespace, and a prefix of "*" allows every reference. Prefixes are
// compared with the canonical reference (hf://org/name@rev,
// oci://host/repo:tag, https://…).
func ParseAllowlist(s string) (Allowlist, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	a := Allowlist{}
	for entry := range strings.SplitSeq(s, ",") {
		ns, prefixes, ok := strings.Cut(strings.TrimSpace(entry), "=")
		ns = strings.TrimSpace(ns)
		if !ok || ns == "" {
			return nil, fmt.Errorf("allowlist entry %q is not NS=PREFIX[;PREFIX…]", entry)
		}
		if ns != AnyNamespace {
			if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
				return nil, fmt.Errorf("allowlist namespace %q: %s", ns, strings.Join(errs, "; "))
			}
		}
		for p := range strings.SplitSeq(prefixes, ";") {
			if p = strings.TrimSpace(p); p != "" {
				a[ns] = append(a[ns], p)
			}
		}
		if len(a[ns]) == 0 {
			return nil, fmt.Errorf("allowlist entry %q names no prefix", entry)
		}
	}
	return a, nil
}

// Check returns nil when namespace ns may mount the canonical reference ref.
func (a Allowlist) Check(ns, ref string) error {
	if a == nil {
		return nil
	}
	for _, key := range []string{ns, AnyNamespace} {
		for _, p := range a[key] {
			if p == "*" || strings.HasPrefix(ref, p) {
				return nil
			}
		}
	}
	return fmt.Errorf("%w: namespace %q may not mount %s (see --csi-allowed-refs)", ErrNotAllowed, ns, ref)
}
