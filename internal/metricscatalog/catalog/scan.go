package catalog

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

const (
	promPath     = "github.com/prometheus/client_golang/prometheus"
	promautoPath = "github.com/prometheus/client_golang/prometheus/promauto"
	// selfPath is this package, which builds sample collectors from
	// catalogue entries (Lint) and defines no metric of its own.
	selfPath = "github.com/weightd/weightd/internal/metricscatalog/catalog"
)

// constructors are client_golang's collector constructors by name: the type
// they build and whether their second argument is the variable labels.
var constructors = map[string]struct {
	typ Type
	vec bool
}{
	"NewCounter": {Counter, false}, "NewCounterVec": {Counter, true}, "NewCounterFunc": {Counter, false},
	"NewGauge": {Gauge, false}, "NewGaugeVec": {Gauge, true}, "NewGaugeFunc": {Gauge, false},
	"NewHistogram": {Histogram, false}, "NewHistogramVec": {Histogram, true},
	"NewSummary": {Summary, false}, "NewSummaryVec": {Summary, true},
	"NewUntypedFunc": {Untyped, false},
}

// constMetrics are the functions that make a metric from a Desc, by the
// type they make (empty: the type is their ValueType argument).
var constMetrics = map[string]Type{
	"MustNewConstMetric": "", "NewConstMetric": "",
	"MustNewConstMetricWithCreatedTimestamp": "", "NewConstMetricWithCreatedTimestamp": "",
	"MustNewConstHistogram": Histogram, "NewConstHistogram": Histogram,
	"MustNewConstHistogramWithCreatedTimestamp": Histogram, "NewConstHistogramWithCreatedTimestamp": Histogram,
	"MustNewConstSummary": Summary, "NewConstSummary": Summary,
	"MustNewConstSummaryWithCreatedTimestamp": Summary, "NewConstSummaryWithCreatedTimestamp": Summary,
}

var valueTypes = map[string]Type{"CounterValue": Counter, "GaugeValue": Gauge, "UntypedValue": Untyped}

// Scan reads every non-test Go file of the module at root (skipping testdata,
// vendor and hidden directories) and returns the metrics they define.
func Scan(root string) (*Catalogue, error) {
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		return nil, fmt.Errorf("reading the module: %w", err)
	}
	module := modulePath(gomod)
	if module == "" {
		return nil, fmt.Errorf("no module path in %s", filepath.Join(root, "go.mod"))
	}
	s := &scanner{root: root, fset: token.NewFileSet(), pkgs: map[string]*pkg{}}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (name == "testdata" || name == "vendor" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_")) {
				return filepath.SkipDir
			}
			if path != root {
				if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
					return filepath.SkipDir // another module
				}
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			return nil
		}
		return s.parse(path, module)
	})
	if err != nil {
		return nil, err
	}
	return s.catalogue()
}

// modulePath is the module path a go.mod file declares, or "".
func modulePath(gomod []byte) string {
	for line := range strings.Lines(string(gomod)) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "module"); ok && rest != "" && (rest[0] == ' ' || rest[0] == '\t') {
			return strings.Trim(strings.TrimSpace(rest), `"`)
		}
	}
	return ""
}

// pkg is one package's parsed files and its package-level declarations.
type pkg struct {
	files []*file
	decls map[string]ast.Expr // package-level const and var names → value
}

type file struct {
	ast  *ast.File
	rel  string            // slash-separated path from the module root
	imps map[string]string // local name → import path
}

type scanner struct {
	root string
	fset *token.FileSet
	pkgs map[string]*pkg // import path → package
}

func (s *scanner) parse(path, module string) error {
	f, err := parser.ParseFile(s.fset, path, nil, parser.SkipObjectResolution)
	if err != nil {
		return fmt.Errorf("parsing %s: %w", path, err)
	}
	rel, err := filepath.Rel(s.root, path)
	if err != nil {
		return err
	}
	rel = filepath.ToSlash(rel)
	imp := module
	if dir := filepath.ToSlash(filepath.Dir(rel)); dir != "." {
		imp += "/" + dir
	}
	p := s.pkgs[imp]
	if p == nil {
		p = &pkg{decls: map[string]ast.Expr{}}
		s.pkgs[imp] = p
	}
	fl := &file{ast: f, rel: rel, imps: map[string]string{}}
	for _, is := range f.Imports {
		ip, err := strconv.Unquote(is.Path.Value)
		if err != nil {
			return fmt.Errorf("%s: import %s: %w", s.fset.Position(is.Pos()), is.Path.Value, err)
		}
		local := ip[strings.LastIndex(ip, "/")+1:]
		if is.Name != nil {
			local = is.Name.Name
		}
		fl.imps[local] = ip
	}
	p.files = append(p.files, fl)
	for _, d := range f.Decls {
		gd, ok := d.(*ast.GenDecl)
		if !ok || (gd.Tok != token.CONST && gd.Tok != token.VAR) {
			continue
		}
		for _, spec := range gd.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, n := range vs.Names {
				if i < len(vs.Values) {
					p.decls[n.Name] = vs.Values[i]
				}
			}
		}
	}
	return nil
}

// ctx is where an expression is evaluated: its package and file.
type ctx struct {
	s *scanner
	p *pkg
	f *file
}

func (c ctx) errorf(n ast.Node, format string, args ...any) error {
	return fmt.Errorf("%s: %s", c.pos(n), fmt.Sprintf(format, args...))
}

func (c ctx) pos(n ast.Node) string {
	p := c.s.fset.Position(n.Pos())
	return fmt.Sprintf("%s:%d", c.f.rel, p.Line)
}

// isProm reports whether x names the prometheus package (or promauto, or
// promauto.With(r)) in c's file.
func (c ctx) isProm(x ast.Expr) bool {
	switch x := x.(type) {
	case *ast.Ident:
		ip := c.f.imps[x.Name]
		return ip == promPath || ip == promautoPath
	case *ast.CallExpr:
		sel, ok := x.Fun.(*ast.SelectorExpr)
		if !ok || sel.Sel.Name != "With" {
			return false
		}
		id, ok := sel.X.(*ast.Ident)
		return ok && c.f.imps[id.Name] == promautoPath
	}
	return false
}

// promCall returns the name of the prometheus function call calls, or "".
func (c ctx) promCall(call *ast.CallExpr) string {
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok || !c.isProm(sel.X) {
		return ""
	}
	return sel.Sel.Name
}

// str evaluates a string constant expression: literals, constants of this or
// another package of the module, +, and prometheus.BuildFQName.
func (c ctx) str(e ast.Expr, depth int) (string, error) {
	if depth > 32 {
		return "", c.errorf(e, "constant too deep")
	}
	switch e := e.(type) {
	case *ast.BasicLit:
		if e.Kind != token.STRING {
			break
		}
		return strconv.Unquote(e.Value)
	case *ast.ParenExpr:
		return c.str(e.X, depth+1)
	case *ast.BinaryExpr:
		if e.Op != token.ADD {
			break
		}
		a, err := c.str(e.X, depth+1)
		if err != nil {
			return "", err
		}
		b, err := c.str(e.Y, depth+1)
		return a + b, err
	case *ast.Ident:
		if v, ok := c.p.decls[e.Name]; ok {
			return c.inPkgOf(v).str(v, depth+1)
		}
	case *ast.SelectorExpr:
		if id, ok := e.X.(*ast.Ident); ok {
			if p := c.s.pkgs[c.f.imps[id.Name]]; p != nil {
				if v, ok := p.decls[e.Sel.Name]; ok {
					return ctx{c.s, p, c.fileOf(p, v)}.str(v, depth+1)
				}
			}
		}
	case *ast.CallExpr:
		if c.promCall(e) == "BuildFQName" && len(e.Args) == 3 {
			var parts []string
			for _, a := range e.Args {
				v, err := c.str(a, depth+1)
				if err != nil {
					return "", err
				}
				parts = append(parts, v)
			}
			return fqName(parts[0], parts[1], parts[2]), nil
		}
	}
	return "", c.errorf(e, "%s is not a string constant the catalogue can read", c.text(e))
}

// inPkgOf returns c moved to the file of c's package that holds v.
func (c ctx) inPkgOf(v ast.Expr) ctx {
	return ctx{c.s, c.p, c.fileOf(c.p, v)}
}

func (c ctx) fileOf(p *pkg, n ast.Node) *file {
	for _, f := range p.files {
		if f.ast.FileStart <= n.Pos() && n.Pos() < f.ast.FileEnd {
			return f
		}
	}
	return c.f
}

// strs evaluates a label list: nil, or a composite literal of string
// constants, or a package-level variable holding one.
func (c ctx) strs(e ast.Expr, depth int) ([]string, error) {
	if depth > 32 {
		return nil, c.errorf(e, "label list too deep")
	}
	switch e := e.(type) {
	case *ast.Ident:
		if e.Name == "nil" {
			return nil, nil
		}
		if v, ok := c.p.decls[e.Name]; ok {
			return c.inPkgOf(v).strs(v, depth+1)
		}
	case *ast.CompositeLit:
		var out []string
		for _, el := range e.Elts {
			v, err := c.str(el, depth+1)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		return out, nil
	}
	return nil, c.errorf(e, "%s is not a label list the catalogue can read (write a []string literal)", c.text(e))
}

// text is a short rendering of e for error messages.
func (c ctx) text(e ast.Expr) string {
	start, end := c.s.fset.Position(e.Pos()), c.s.fset.Position(e.End())
	b, err := os.ReadFile(filepath.Join(c.s.root, filepath.FromSlash(c.f.rel)))
	if err != nil || end.Offset > len(b) || end.Offset-start.Offset > 80 {
		return fmt.Sprintf("%T", e)
	}
	return string(b[start.Offset:end.Offset])
}

func fqName(namespace, subsystem, name string) string {
	var parts []string
	for _, p := range []string{namespace, subsystem, name} {
		if p != "" {
			parts = append(parts, p)
		}
	}
	if name == "" {
		return ""
	}
	return strings.Join(parts, "_")
}

// opts reads a prometheus XxxOpts composite literal.
func (c ctx) opts(e ast.Expr) (name, help string, constLabels []string, err error) {
	if u, ok := e.(*ast.UnaryExpr); ok && u.Op == token.AND {
		e = u.X
	}
	lit, ok := e.(*ast.CompositeLit)
	if !ok {
		return "", "", nil, c.errorf(e, "%s is not an Opts literal the catalogue can read", c.text(e))
	}
	var ns, sub string
	for _, el := range lit.Elts {
		kv, ok := el.(*ast.KeyValueExpr)
		if !ok {
			return "", "", nil, c.errorf(el, "Opts literal without field names")
		}
		key, _ := kv.Key.(*ast.Ident)
		if key == nil {
			continue
		}
		switch key.Name {
		case "Namespace":
			ns, err = c.str(kv.Value, 0)
		case "Subsystem":
			sub, err = c.str(kv.Value, 0)
		case "Name":
			name, err = c.str(kv.Value, 0)
		case "Help":
			help, err = c.str(kv.Value, 0)
		case "ConstLabels":
			constLabels, err = c.mapKeys(kv.Value)
		}
		if err != nil {
			return "", "", nil, err
		}
	}
	if name = fqName(ns, sub, name); name == "" {
		return "", "", nil, c.errorf(e, "metric without a name")
	}
	return name, help, constLabels, nil
}

// mapKeys reads the keys of a prometheus.Labels literal (nil: none).
func (c ctx) mapKeys(e ast.Expr) ([]string, error) {
	if id, ok := e.(*ast.Ident); ok && id.Name == "nil" {
		return nil, nil
	}
	lit, ok := e.(*ast.CompositeLit)
	if !ok {
		return nil, c.errorf(e, "%s is not a constant labels literal the catalogue can read", c.text(e))
	}
	var keys []string
	for _, el := range lit.Elts {
		kv, ok := el.(*ast.KeyValueExpr)
		if !ok {
			return nil, c.errorf(el, "constant labels literal without keys")
		}
		k, err := c.str(kv.Key, 0)
		if err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	return keys, nil
}

// desc is a prometheus.NewDesc call bound to a name (a variable or field),
// whose type comes from the const metrics made from that name.
type desc struct {
	m    Metric
	at   string
	bind string
	pkg  *pkg
}

func (s *scanner) catalogue() (*Catalogue, error) {
	cat := &Catalogue{}
	var errs []error
	var descs []desc
	descTypes := map[*pkg]map[string][]Type{} // package → bound name → types of the const metrics made from it
	paths := make([]string, 0, len(s.pkgs))
	for p := range s.pkgs {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, ip := range paths {
		if ip == selfPath {
			continue
		}
		p := s.pkgs[ip]
		descTypes[p] = map[string][]Type{}
		for _, f := range p.files {
			c := ctx{s, p, f}
			bound := map[*ast.CallExpr]string{}
			ast.Inspect(f.ast, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.AssignStmt:
					for i, r := range n.Rhs {
						if i < len(n.Lhs) {
							bindDesc(c, r, n.Lhs[i], bound)
						}
					}
				case *ast.ValueSpec:
					for i, r := range n.Values {
						if i < len(n.Names) {
							bindDesc(c, r, n.Names[i], bound)
						}
					}
				case *ast.KeyValueExpr:
					bindDesc(c, n.Value, n.Key, bound)
				case *ast.CallExpr:
					fn := c.promCall(n)
					if k, ok := constructors[fn]; ok {
						m, err := c.collector(n, k.typ, k.vec)
						if err == nil {
							err = cat.add(m)
						}
						errs = append(errs, err)
					} else if fn == "NewDesc" {
						d, err := c.desc(n, bound[n])
						if err != nil {
							errs = append(errs, err)
						} else {
							descs = append(descs, d)
						}
					} else if typ, ok := constMetrics[fn]; ok && len(n.Args) > 0 {
						if typ == "" {
							var err error
							if typ, err = c.valueType(n); err != nil {
								errs = append(errs, err)
								return true
							}
						}
						if name := lastIdent(n.Args[0]); name != "" {
							descTypes[p][name] = append(descTypes[p][name], typ)
						}
					}
				}
				return true
			})
		}
	}
	for _, d := range descs {
		types := slices.Compact(slices.Sorted(slices.Values(descTypes[d.pkg][d.bind])))
		switch len(types) {
		case 0:
			errs = append(errs, fmt.Errorf("%s: no const metric is made from %s (NewDesc %s), so its type is unknown", d.at, d.bind, d.m.Name))
		case 1:
			d.m.Type = types[0]
			errs = append(errs, cat.add(d.m))
		default:
			errs = append(errs, fmt.Errorf("%s: const metrics of types %v are made from %s (NewDesc %s)", d.at, types, d.bind, d.m.Name))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return cat, nil
}

// bindDesc records that the NewDesc call value, if it is one, is bound to
// the name target ends in.
func bindDesc(c ctx, value, target ast.Expr, bound map[*ast.CallExpr]string) {
	call, ok := value.(*ast.CallExpr)
	if !ok || c.promCall(call) != "NewDesc" {
		return
	}
	if name := lastIdent(target); name != "" && name != "_" {
		bound[call] = name
	}
}

// lastIdent is the identifier e ends in: x → x, a.b.c → c, &x → x.
func lastIdent(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.Ident:
		return e.Name
	case *ast.SelectorExpr:
		return e.Sel.Name
	case *ast.UnaryExpr:
		return lastIdent(e.X)
	case *ast.StarExpr:
		return lastIdent(e.X)
	case *ast.ParenExpr:
		return lastIdent(e.X)
	}
	return ""
}

// collector reads a NewXxx(opts[, labels]) call.
func (c ctx) collector(call *ast.CallExpr, typ Type, vec bool) (Metric, error) {
	if len(call.Args) == 0 {
		return Metric{}, c.errorf(call, "constructor without Opts")
	}
	name, help, labels, err := c.opts(call.Args[0])
	if err != nil {
		return Metric{}, err
	}
	if vec {
		if len(call.Args) < 2 {
			return Metric{}, c.errorf(call, "vector constructor without labels")
		}
		vl, err := c.strs(call.Args[1], 0)
		if err != nil {
			return Metric{}, err
		}
		labels = append(labels, vl...)
	}
	return c.metric(call, name, typ, help, labels)
}

func (c ctx) metric(at ast.Node, name string, typ Type, help string, labels []string) (Metric, error) {
	labels = slices.Clone(labels)
	slices.Sort(labels)
	if i := slices.Index(labels, ""); i >= 0 {
		return Metric{}, c.errorf(at, "metric %s has an empty label name", name)
	}
	if len(slices.Compact(slices.Clone(labels))) != len(labels) {
		return Metric{}, c.errorf(at, "metric %s has a label twice: %v", name, labels)
	}
	return Metric{Name: name, Type: typ, Labels: labels, Help: help, Sources: []string{c.f.rel}}, nil
}

// desc reads a NewDesc(fqName, help, variableLabels, constLabels) call
// bound to the name bind.
func (c ctx) desc(call *ast.CallExpr, bind string) (desc, error) {
	if len(call.Args) != 4 {
		return desc{}, c.errorf(call, "NewDesc with %d arguments", len(call.Args))
	}
	if bind == "" {
		return desc{}, c.errorf(call, "NewDesc not assigned to a variable or field, so its type is unknown")
	}
	name, err := c.str(call.Args[0], 0)
	if err != nil {
		return desc{}, err
	}
	help, err := c.str(call.Args[1], 0)
	if err != nil {
		return desc{}, err
	}
	labels, err := c.strs(call.Args[2], 0)
	if err != nil {
		return desc{}, err
	}
	cl, err := c.mapKeys(call.Args[3])
	if err != nil {
		return desc{}, err
	}
	m, err := c.metric(call, name, "", help, append(labels, cl...))
	return desc{m: m, at: c.pos(call), bind: bind, pkg: c.p}, err
}

// valueType reads the prometheus.XxxValue argument of a const metric call.
func (c ctx) valueType(call *ast.CallExpr) (Type, error) {
	if len(call.Args) >= 2 {
		if sel, ok := call.Args[1].(*ast.SelectorExpr); ok && c.isProm(sel.X) {
			if t, ok := valueTypes[sel.Sel.Name]; ok {
				return t, nil
			}
		}
	}
	return "", c.errorf(call, "const metric whose value type is not prometheus.CounterValue, GaugeValue or UntypedValue")
}
