// SPDX-License-Identifier: Apache-2.0

// Package top is `meshwarp top`: a live terminal view of the node's flows
// (observe.Rows), refreshed from the agent's observation, with sorting and
// filtering. Built on Bubble Tea and its table.
package top

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"charm.land/bubbles/v2/table"
	tea "charm.land/bubbletea/v2"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/observe"
)

// ReadFunc reads the agent's observation.
type ReadFunc func() ([]accel.Flow, error)

// Model is the live view.
type Model struct {
	read     ReadFunc
	interval time.Duration
	names    map[uint64]string
	namedAt  time.Time

	prev     []accel.Flow
	prevAt   time.Time
	rows     []observe.Row
	sortBy   string
	filter   string
	editing  bool // typing a filter
	err      error
	table    table.Model
	width    int
	height   int
	sampled  bool
	sampleAt time.Time
}

type tickMsg time.Time

// New returns the view reading with read every interval, sorted by sortBy.
func New(read ReadFunc, interval time.Duration, sortBy, filter string) *Model {
	t := table.New(table.WithColumns(columns(120)), table.WithFocused(true), table.WithHeight(20))
	return &Model{read: read, interval: interval, sortBy: sortBy, filter: filter, table: t, width: 120, height: 24}
}

func columns(width int) []table.Column {
	client := max(16, (width-78)/2)
	server := max(21, width-78-client)
	return []table.Column{
		{Title: "CLIENT", Width: client}, {Title: "SERVER", Width: server}, {Title: "PROTO", Width: 5},
		{Title: "REQ/S", Width: 8}, {Title: "ERR/S", Width: 7}, {Title: "P50", Width: 9}, {Title: "P99", Width: 9},
		{Title: "BYTES/S", Width: 9}, {Title: "ACCEL", Width: 5}, {Title: "HOP", Width: 7},
	}
}

// Init takes the first sample at once.
func (m *Model) Init() tea.Cmd { return func() tea.Msg { return tickMsg(time.Now()) } }

// Update handles keys, resizes and refreshes.
func (m *Model) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
		m.table.SetColumns(columns(m.width))
		m.table.SetWidth(m.width)
		m.table.SetHeight(max(3, m.height-4))
		return m, nil
	case tickMsg:
		m.sample(time.Time(msg))
		return m, tea.Tick(m.interval, func(t time.Time) tea.Msg { return tickMsg(t) })
	case tea.KeyPressMsg:
		if m.editing {
			switch msg.String() {
			case "enter", "esc":
				m.editing = false
			case "backspace":
				if m.filter != "" {
					m.filter = m.filter[:len(m.filter)-1]
				}
			default:
				if t := msg.Key().Text; t != "" {
					m.filter += t
				}
			}
			m.render()
			return m, nil
		}
		switch msg.String() {
		case "q", "ctrl+c":
			return m, tea.Quit
		case "s":
			i := slices.Index(observe.SortOrders, m.sortBy)
			m.sortBy = observe.SortOrders[(i+1)%len(observe.SortOrders)]
			m.render()
			return m, nil
		case "/":
			m.editing = true
			return m, nil
		case "c":
			m.filter = ""
			m.render()
			return m, nil
		}
	}
	var cmd tea.Cmd
	m.table, cmd = m.table.Update(msg)
	return m, cmd
}

// sample reads the observation and computes the rates since the last read.
func (m *Model) sample(now time.Time) {
	flows, err := m.read()
	m.err = err
	if err != nil {
		return
	}
	if m.names == nil || now.Sub(m.namedAt) > 5*time.Second {
		m.names, m.namedAt = observe.NetnsNames(), now
	}
	if m.prev != nil {
		m.rows = observe.Rows(observe.Sub(flows, m.prev), now.Sub(m.prevAt).Seconds(), m.names)
		m.sampled, m.sampleAt = true, now
	}
	m.prev, m.prevAt = flows, now
	m.render()
}

func (m *Model) render() {
	rows := observe.Filter(slices.Clone(m.rows), m.filter)
	observe.SortRows(rows, m.sortBy)
	out := make([]table.Row, 0, len(rows))
	for _, r := range rows {
		out = append(out, table.Row{r.Client, r.Server, r.Protocol,
			fmt.Sprintf("%.1f", r.RequestsPerSecond), fmt.Sprintf("%.1f", r.ErrorsPerSecond),
			Duration(r.P50Seconds), Duration(r.P99Seconds), Bytes(r.BytesPerSecond),
			fmt.Sprintf("%.0f%%", 100*r.AcceleratedShare), r.Hop})
	}
	m.table.SetRows(out)
}

// View draws the header, the table and the keys.
func (m *Model) View() tea.View {
	var b strings.Builder
	status := "sampling..."
	if m.sampled {
		status = fmt.Sprintf("%d flows at %s", len(m.table.Rows()), m.sampleAt.Format("15:04:05"))
	}
	fmt.Fprintf(&b, "meshwarp top  %s, every %v, sorted by %s", status, m.interval, m.sortBy)
	if m.filter != "" || m.editing {
		fmt.Fprintf(&b, ", filter: %s", m.filter)
		if m.editing {
			b.WriteString("_")
		}
	}
	b.WriteString("\n")
	if m.err != nil {
		fmt.Fprintf(&b, "error: %v\n", m.err)
	}
	b.WriteString(m.table.View())
	b.WriteString("\n s: sort (requests, errors, p99, bytes)  /: filter  c: clear filter  up/down: scroll  q: quit\n")
	v := tea.NewView(b.String())
	v.AltScreen = true
	return v
}

// Duration renders seconds for a narrow column.
func Duration(s float64) string {
	switch {
	case s == 0:
		return "-"
	case s < 1e-3:
		return fmt.Sprintf("%.0fus", s*1e6)
	case s < 1:
		return fmt.Sprintf("%.1fms", s*1e3)
	}
	return fmt.Sprintf("%.2fs", s)
}

// Bytes renders a byte rate.
func Bytes(b float64) string {
	switch {
	case b >= 1e9:
		return fmt.Sprintf("%.1fG", b/1e9)
	case b >= 1e6:
		return fmt.Sprintf("%.1fM", b/1e6)
	case b >= 1e3:
		return fmt.Sprintf("%.1fk", b/1e3)
	}
	return fmt.Sprintf("%.0f", b)
}
